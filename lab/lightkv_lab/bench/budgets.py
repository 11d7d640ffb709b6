"""Any preset at a kept-fraction target: the one rule the quality and efficiency benchmarks share.

A target ``t`` is the vision KV kept on average over the decoder's layers. How a preset gets
there depends on where its stages run:

* before the LLM (``pre_llm``: VisionZip, VisPruner, DivPrune, CDPruner, downsampling, the
  LightKV pre-LLM mode): every layer sees the kept tokens, so the removal ratio is ``1 - t``;
* on each layer's cache (ElasticCache, H2O): every layer keeps ``t`` of its vision entries;
* a `BudgetSchedule`: its target is set to ``t``; a `KeptFractionSchedule` (``lightkv-budget``):
  its stages at their relative depths, then as the next case;
* inside the prefill (LightKV, ToMe, FastV, PyramidDrop, DART, ...): the preset's stages,
  scaled from a reference depth, get one common ratio found by bisection
  (`lightkv.policies.schedulers.budget_schedule`), moved earlier or repeated after every
  layer when the ratio cap (`MAX_RATIO`) cannot reach ``t`` (``how`` says which).

Every benchmark takes kept fractions in one range, ``[MIN_KEPT_FRACTION, 1]``
(`check_kept_fractions`): 1 is the uncompressed cache, and below 1% a 576-token image keeps
fewer than 6 tokens, where the targets stop meaning anything (``1e-300`` used to run as
"target 0.00").
"""

from __future__ import annotations

from dataclasses import replace

from lightkv.policies.schedulers import budget_schedule

__all__ = [
    "MAX_KEPT_FRACTIONS",
    "MAX_RATIO",
    "MIN_KEPT_FRACTION",
    "REF_DEPTH",
    "check_kept_fractions",
    "method_pipeline",
]

MIN_KEPT_FRACTION = 0.01
"""The smallest kept fraction a benchmark accepts (the range is ``[0.01, 1]``)."""

MAX_KEPT_FRACTIONS = 16
"""The most kept fractions one benchmark run takes (each is a run of every method)."""


def check_kept_fractions(values, option: str = "--kept-fractions") -> tuple[float, ...]:
    """``values`` as floats, duplicates merged (first order kept), each checked against the
    one range every benchmark uses, ``[MIN_KEPT_FRACTION, 1]``.

    Raises:
        ValueError: one line naming ``option`` and the first bad value (NaN, out of range),
            or more than `MAX_KEPT_FRACTIONS` distinct values.
    """
    out: list[float] = []
    for v in values:
        f = float(v)
        if not MIN_KEPT_FRACTION <= f <= 1.0:  # NaN fails too
            raise ValueError(
                f"{option} takes kept fractions in [{MIN_KEPT_FRACTION}, 1] (1 = uncompressed), "
                f"got {v!r}"
            )
        if f not in out:
            out.append(f)
    if len(out) > MAX_KEPT_FRACTIONS:
        raise ValueError(
            f"{option} takes at most {MAX_KEPT_FRACTIONS} distinct values (each runs every method "
            f"again), got {len(out):,}"
        )
    return tuple(out)


REF_DEPTH = 32
"""The depth the shipped presets' layer lists are written for (LLaVA-1.5-7B)."""

MAX_RATIO = {
    "fastv": 0.95,
    "pdrop": 0.95,
    "random": 0.95,
    "pool": 0.75,
    "dart": 0.99,
    "lightkv-first-layer": 0.99,
}
"""The most a stage of each method can remove; 0.5 (a parity split) for the others."""


def method_pipeline(name: str, num_layers: int, target: float, ref_depth: int = REF_DEPTH):
    """``(pipeline, how)``: preset ``name`` on a ``num_layers`` decoder at ``target``.

    ``how`` is ``"before the LLM"``, ``"before the LLM and later"`` (VScan's two stages:
    the later stage keeps its ratio, the first one's is fitted), ``"cache"``, or
    `budget_schedule`'s ``"scaled"`` / ``"extra stages"`` / ``"min"``; ``ref_depth`` is the
    depth the preset's layers are written for.

    Raises:
        ValueError: a preset whose schedule cannot be put at a target (one line naming it).
    """
    from lightkv.adapters.modes.h2o import H2OMode
    from lightkv.policies import (
        BudgetSchedule,
        CacheSchedule,
        KeptFractionSchedule,
        PreLLMSchedule,
        PreLLMThenLayer,
    )
    from lightkv.policies.schedulers import ExplicitSchedule, scale_layers
    from lightkv.presets import get_preset

    pipe = get_preset(name)
    sched = pipe.scheduler
    if isinstance(pipe.mode, H2OMode) and sched is None:  # eviction to the target, no stage
        return replace(pipe, mode=replace(pipe.mode, budget=target)), "cache"
    if isinstance(
        sched, PreLLMSchedule
    ):  # every layer sees the kept tokens: kept fraction = 1 - ratio
        return replace(pipe, scheduler=replace(sched, removal_ratio=1.0 - target)), "before the LLM"
    if isinstance(sched, CacheSchedule):
        return replace(
            pipe, scheduler=replace(sched, removal_ratio=round(1.0 - target, 6))
        ), "cache"
    if isinstance(
        sched, PreLLMThenLayer
    ):  # stage 1 keeps its share; stage 0 keeps what reaches the target
        later = sched.later_layer(num_layers)
        share = (
            later + 1 + (num_layers - later - 1) * (1.0 - sched.later_removal_ratio)
        ) / num_layers
        kept = min(1.0, target / share)
        return replace(
            pipe, scheduler=replace(sched, removal_ratio=round(1.0 - kept, 6))
        ), "before the LLM and later"
    if isinstance(sched, BudgetSchedule):  # already a target, reached as the benchmarks do: set it
        return replace(pipe, scheduler=replace(sched, kept_fraction=target)), "budget"
    if isinstance(
        sched, KeptFractionSchedule
    ):  # its stages at their relative depths, then as below
        layers = sorted({min(num_layers - 1, round(f * num_layers)) for f in sched.relative_layers})
        schedule, how = budget_schedule(
            layers,
            num_layers,
            target,
            sched.max_removal_ratio,
            windows_per_side=sched.windows_per_side,
        )
        return replace(pipe, scheduler=schedule), how
    if not isinstance(sched, ExplicitSchedule):
        raise ValueError(
            f"preset {name!r} ({type(sched).__name__}) cannot be put at a kept fraction: "
            "leave it out of --kept-fractions runs"
        )
    layers = scale_layers(sched.layers, ref_depth, num_layers)
    schedule, how = budget_schedule(
        layers,
        num_layers,
        target,
        MAX_RATIO.get(name, 0.5),
        windows_per_side=sched.windows_per_side,
        window_size=sched.window_size,
    )
    return replace(pipe, scheduler=schedule), how
