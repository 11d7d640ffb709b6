"""Placement: where a pipeline's planned stages run, independent of what they do.

A schedule plans stages for its method's own place (DivPrune before the LLM, LightKV after
decoder layers, ElasticCache on each layer's cache). `place` moves the same stages to
another place at the same vision-KV budget, so any keep-set or merge method runs in any of
the three by one field (``placement:`` in YAML, `lightkv.Pipeline.placement`):

- ``planned``: the stages become the schedule's own; kept vision KV: the schedule's.
- ``pre_llm``: the stages become one stage before decoder layer 0; kept vision KV: the
  planned average, at every layer.
- ``layer``: the stages become stages after decoder layers, a pre-LLM stage moving after
  layer 0; kept vision KV: the planned average.
- ``cache``: the stages become one stage on each layer's cache after its prefill; kept vision
  KV: the planned share, layer by layer.

Each moved stage keeps its windows (``pre_llm``: the first planned stage's; ``cache``: the
windows of the last stage that acted before the layer). What cannot be placed is refused
with a `ValueError` that says why.
"""

from __future__ import annotations

from dataclasses import replace

from .core import StageSpec, average_kept_fraction

__all__ = ["PLACEMENTS", "place"]

PLACEMENTS: tuple[str, ...] = ("planned", "pre_llm", "layer", "cache")
"""The places `place` moves stages to (``planned``: where the schedule put them)."""


def _kept_at(stages: list[StageSpec], num_layers: int) -> list[tuple[float, StageSpec | None]]:
    """Per decoder layer: the share of the vision KV the planned stages leave in its cache,
    and the last stage that acted before the layer cached (None: none did)."""
    out = []
    for layer in range(num_layers):
        kept, last = 1.0, None
        for s in stages:
            acts = s.layer <= layer if s.mode in ("pre_llm", "cache") else s.layer < layer
            if acts and (s.mode != "cache" or s.layer == layer):
                kept *= 1.0 - s.removal_ratio
                last = s
        out.append((kept, last))
    return out


def place(stages: list[StageSpec], placement: str, num_layers: int) -> list[StageSpec]:
    """The planned ``stages`` of a ``num_layers`` decoder, moved to ``placement``.

    Raises:
        ValueError: an unknown placement, or stages that cannot keep their budget there (a
            pre-LLM stage moved after layer 0 of a one-layer decoder, or a budget no stage
            after layer 0 can reach).
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")
    if placement == "planned" or not stages:
        return list(stages)
    if placement == "cache":
        return [
            replace(last, layer=layer, removal_ratio=round(1.0 - kept, 12), mode="cache")
            for layer, (kept, last) in enumerate(_kept_at(stages, num_layers))
            if last is not None and kept < 1.0
        ]
    target = average_kept_fraction(stages, num_layers)
    if placement == "pre_llm":
        return [replace(stages[0], layer=0, removal_ratio=1.0 - target, mode="pre_llm")]
    # placement "layer": stages after layers stay; a schedule of a pre-LLM stage or of cache
    # stages becomes one stage after layer 0 that keeps the same average
    if all(s.mode == "layer" for s in stages):
        return list(stages)
    if any(s.mode == "layer" for s in stages):
        raise ValueError(
            "placement 'layer' takes a schedule of stages after layers, or one of a pre-LLM "
            "stage or cache stages alone; this one mixes them (a pre-LLM stage, then stages "
            "after layers): keep placement 'planned'"
        )
    if num_layers < 2:
        raise ValueError(
            "placement 'layer' moves a stage after layer 0, but a one-layer decoder has no "
            "later layer to keep the budget in: use placement 'pre_llm' or 'cache'"
        )
    ratio = (1.0 - target) * num_layers / (num_layers - 1)
    if ratio >= 1.0:
        raise ValueError(
            f"placement 'layer' cannot keep {target:.3f} of the vision KV with a stage after "
            f"layer 0 of a {num_layers}-layer decoder (it would remove {ratio:.2f} of the "
            "tokens): use placement 'pre_llm' or 'cache'"
        )
    return [replace(stages[0], layer=0, removal_ratio=ratio, mode="layer")]
