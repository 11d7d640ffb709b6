"""Depth arithmetic shared by the scheduler families: layers moved between depths
(`scale_layers`) and the kept-fraction knob's limits, refusal and ratio fit.

Every family puts itself at a target kept fraction ``t`` in its own method,
`Scheduler.at_kept_fraction`, keeping where its stages run (a stage after layer 1 stays
after layer 1, a stage before the LLM stays there); this module holds what they share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .core import (
    KeptFractionOutOfReach,
    ScheduleError,
    StageSpec,
    average_kept_fraction,
    ratio_for_target,
)

__all__ = [
    "MAX_REMOVAL_RATIO",
    "REACH_TOLERANCE",
    "REFERENCE_DEPTH",
    "StageCap",
    "check_target",
    "fit_common_ratio",
    "out_of_reach",
    "scale_layers",
    "stage_cap",
]

REACH_TOLERANCE = 0.03
"""How far above a target the nearest reachable kept fraction may be and still run (at that
nearest fraction) rather than be refused: LightKV's own stages keep 0.574 on 32 layers, and
a 55% target should run them, not fail. Below `lightkv.adapters.report.TARGET_TOLERANCE`,
so a session run this way does not warn."""

MAX_REMOVAL_RATIO = 0.99
"""The largest removal ratio the knob gives a stage whose policies state no limit of their
own (a ratio of 1 would leave a window empty)."""

REFERENCE_DEPTH = 32
"""The depth the shipped presets' fixed layer lists are written for (LLaVA-1.5-7B): on a
shallower decoder, where they do not fit, the knob moves them with `scale_layers` from it."""

StageCap = Callable[[int, StageSpec], float]
"""The largest removal ratio stage ``index`` with spec ``spec`` can really make (its
partitioner's and pruner's limits: `lightkv.Pipeline.max_removal_ratio`)."""


def scale_layers(layers: Sequence[int], ref_depth: int, depth: int) -> tuple[int, ...]:
    """Stage layers of a ``ref_depth``-layer schedule moved to a ``depth``-layer decoder.

    A stage after 0-based layer ``l`` leaves ``l + 1`` layers uncompressed by it; that
    count is scaled by ``depth / ref_depth`` and rounded (at least 1, strictly increasing,
    the last stage before the last layer), so each level of the KV step keeps about the
    same share of the layers. 12/18/24 of 32 -> 2/4/5 of 8 (LLaVA), 12/17/22 of 28 ->
    3/4/6 of 8 (Qwen2.5-VL).

    Raises:
        ValueError: the scaled stages do not fit ``depth`` layers.
    """
    out: list[int] = []
    for l in layers:
        kept = max(1, round((l + 1) * depth / ref_depth))
        if out:
            kept = max(kept, out[-1] + 2)
        out.append(kept - 1)
    if out and out[-1] > depth - 2:
        raise ValueError(
            f"schedule {list(layers)} of {ref_depth} layers does not fit {depth} layers: its "
            f"{len(out)} stage(s) need at least {len(out) + 1} layers (a stage after each of the "
            "first ones, and a layer after the last)"
        )
    return tuple(out)


def check_target(kept_fraction: object) -> float:
    """``kept_fraction`` as a float in ``(0, 1]``.

    Raises:
        ScheduleError: a bool, a non-number, NaN or a value outside ``(0, 1]``.
    """
    if isinstance(kept_fraction, bool) or not isinstance(kept_fraction, (int, float)):
        raise ScheduleError(
            f"kept_fraction must be a number in (0, 1], got {kept_fraction!r}", "kept_fraction"
        )
    t = float(kept_fraction)
    if not 0.0 < t <= 1.0:  # NaN fails too
        raise ScheduleError(
            f"kept_fraction must be in (0, 1] (1 keeps everything), got {kept_fraction!r}",
            "kept_fraction",
        )
    return t


def stage_cap(cap: StageCap | float, index: int, spec: StageSpec) -> float:
    """The largest ratio the knob gives stage ``index``: its policies' limit ``cap`` (a
    number for every stage, or a `StageCap`), at most `MAX_REMOVAL_RATIO`."""
    value = cap(index, spec) if callable(cap) else float(cap)
    return min(float(value), MAX_REMOVAL_RATIO)


def out_of_reach(
    target: float, nearest: float, num_layers: int, how: str
) -> KeptFractionOutOfReach:
    """The one-line refusal of ``target``: with ``how`` (a phrase: its stages at their
    limits) the schedule keeps ``nearest`` at best."""
    return KeptFractionOutOfReach(
        f"kept fraction {target:g} is out of reach on {num_layers} layers with {how}; the "
        f"nearest reachable kept fraction is {nearest:.3f}",
        target,
        nearest,
    )


def fit_common_ratio(
    make: Callable[[float], list[StageSpec]],
    num_layers: int,
    target: float,
    cap: StageCap | float,
    how: str,
) -> float:
    """One common removal ratio for the stages ``make(ratio)`` plans, keeping ``target``.

    The smallest ratio at most the stages' common limit (`stage_cap`) whose
    `average_kept_fraction` is at most ``target``, by bisection and rounded to 4 decimals
    (as `budget_schedule`); the limit itself when even that keeps more but no more than
    `REACH_TOLERANCE` above the target.

    Raises:
        KeptFractionOutOfReach: the limit keeps more than ``target + REACH_TOLERANCE``
            (``how`` says what the stages are, for the message).
    """
    probe = make(0.0)
    limit = min((stage_cap(cap, i, s) for i, s in enumerate(probe)), default=MAX_REMOVAL_RATIO)

    def kept(p: float) -> float:
        return average_kept_fraction(make(p), num_layers)

    lowest = kept(limit)
    if lowest > target + REACH_TOLERANCE:
        raise out_of_reach(
            target,
            lowest,
            num_layers,
            f"{how} (removal ratio at most {limit:g}{' each' if len(probe) > 1 else ''})",
        )
    return round(ratio_for_target(kept, target, limit), 4)
