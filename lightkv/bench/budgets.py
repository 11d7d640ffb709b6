"""Any preset at a kept-fraction target: the one rule the quality and efficiency benchmarks share.

A target ``t`` is the vision KV kept on average over the decoder's layers. How a preset gets
there depends on where its stages run:

* before the LLM (``pre_llm``: VisionZip, VisPruner, DivPrune, CDPruner, downsampling, the
  LightKV pre-LLM mode): every layer sees the kept tokens, so the removal ratio is ``1 - t``;
* on each layer's cache (ElasticCache, H2O): every layer keeps ``t`` of its vision entries;
* inside the prefill (LightKV, ToMe, FastV, PyramidDrop, DART, ...): the preset's stages,
  scaled from a reference depth, get one common ratio found by bisection
  (`lightkv.policies.schedulers.budget_schedule`), moved earlier or repeated after every
  layer when the ratio cap (`MAX_RATIO`) cannot reach ``t`` (``how`` says which).
"""

from __future__ import annotations

from dataclasses import replace

from ..policies.schedulers import budget_schedule

__all__ = ["MAX_RATIO", "REF_DEPTH", "method_pipeline"]

REF_DEPTH = 32
"""The depth the shipped presets' layer lists are written for (LLaVA-1.5-7B)."""

MAX_RATIO = {"fastv": 0.95, "pdrop": 0.95, "random": 0.95, "pool": 0.75, "dart": 0.99, "lightkv-first-layer": 0.99}
"""The most a stage of each method can remove; 0.5 (a parity split) for the others."""


def method_pipeline(name: str, num_layers: int, target: float, ref_depth: int = REF_DEPTH):
    """``(pipeline, how)``: preset ``name`` on a ``num_layers`` decoder at ``target``.

    ``how`` is ``"before the LLM"``, ``"before the LLM and later"`` (VScan's two stages:
    the later stage keeps its ratio, the first one's is fitted), ``"cache"``, or
    `budget_schedule`'s ``"scaled"`` / ``"extra stages"`` / ``"min"``; ``ref_depth`` is the
    depth the preset's layers are written for.

    Raises:
        TypeError: a preset whose schedule cannot be put at a target.
    """
    from ..policies import CacheSchedule, H2OSchedule, PreLLMSchedule, PreLLMThenLayer
    from ..policies.schedulers import ExplicitSchedule, scale_layers
    from ..presets import get_preset

    pipe = get_preset(name)
    sched = pipe.scheduler
    if isinstance(sched, PreLLMSchedule):  # every layer sees the kept tokens: kept fraction = 1 - ratio
        return replace(pipe, scheduler=replace(sched, removal_ratio=1.0 - target)), "before the LLM"
    if isinstance(sched, CacheSchedule):
        return replace(pipe, scheduler=replace(sched, removal_ratio=round(1.0 - target, 6))), "cache"
    if isinstance(sched, PreLLMThenLayer):  # stage 1 keeps its share; stage 0 keeps what reaches the target
        later = sched.later_layer(num_layers)
        share = (later + 1 + (num_layers - later - 1) * (1.0 - sched.later_removal_ratio)) / num_layers
        kept = min(1.0, target / share)
        return replace(pipe, scheduler=replace(sched, removal_ratio=round(1.0 - kept, 6))), "before the LLM and later"
    if isinstance(sched, H2OSchedule):
        return replace(pipe, scheduler=replace(sched, budget=target)), "cache"
    if not isinstance(sched, ExplicitSchedule):
        raise TypeError(f"preset {name!r} has no explicit schedule to scale")
    layers = scale_layers(sched.layers, ref_depth, num_layers)
    schedule, how = budget_schedule(layers, num_layers, target, MAX_RATIO.get(name, 0.5),
                                    windows_per_side=sched.windows_per_side, window_size=sched.window_size)
    return replace(pipe, scheduler=schedule), how
