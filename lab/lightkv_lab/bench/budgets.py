"""Any preset at a kept-fraction target, as the quality, ablation and efficiency benchmarks
run it: the library's knob (``lightkv.load(name, kept_fraction=t)``,
`lightkv.Pipeline.kept_fraction`), resolved for the model's depth (`knob_pipeline`).

A target ``t`` is the vision KV kept on average over the decoder's layers. Each scheduler
family puts itself there keeping where its stages run
(`lightkv.policies.Scheduler.at_kept_fraction`): a pre-LLM method removes ``1 - t``
before the LLM, a cache method keeps ``t`` of every layer's cache, H2O's budget is ``t``,
VScan fits its first stage, and a method with stages after layers (LightKV, ToMe, FastV,
PyramidDrop, DART, ...) keeps its layers (scaled from 32 where they do not fit a shallower
decoder) with one common ratio within its policies' limits. Where the method cannot reach
``t`` on the model, the library refuses in one line naming the nearest fraction it can
reach; a benchmark then runs it there (``how: "nearest"``), so its row shows the method at
its limit rather than a hole.

Every benchmark takes kept fractions in one range, ``[MIN_KEPT_FRACTION, 1]``
(`check_kept_fractions`): 1 is the uncompressed cache, and below 1% a 576-token image keeps
fewer than 6 tokens, where the targets stop meaning anything (``1e-300`` used to run as
"target 0.00").
"""

from __future__ import annotations

from lightkv.pipeline import Pipeline
from lightkv.policies import KeptFractionOutOfReach, ScheduleError

__all__ = [
    "VARIANTS",
    "MAX_KEPT_FRACTIONS",
    "MIN_KEPT_FRACTION",
    "check_kept_fractions",
    "knob_pipeline",
]

VARIANTS = {
    "lightkv-cover-no-pa": ("lightkv-cover", {"proportional_attention": False}),
}
"""Benchmark-only variants of a preset, by name: ``(preset, fields replaced)``. Proportional
attention off is what FlashAttention-2 and vLLM users of a merging preset got before the
one-channel route (`lightkv.adapters.bias`)."""

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


def knob_pipeline(preset: str | Pipeline, num_layers: int, target: float) -> tuple[Pipeline, str]:
    """``(pipeline, how)``: ``preset`` (a name or a pipeline) at kept fraction ``target`` on a
    ``num_layers`` decoder, through the library's knob, resolved for that depth
    (`lightkv.Pipeline.resolved`: a concrete schedule, so that a part swapped in afterwards
    runs the same stages).

    ``how`` says where its stages run: ``"before the LLM"``, ``"before the LLM and later"``
    (VScan), ``"cache"`` (every layer's cache, or H2O), ``"scaled"`` (after its own layers),
    or ``"nearest"``: ``target`` is out of reach there, and the pipeline runs at the nearest
    fraction the library names.

    Raises:
        ValueError: an unknown preset, or a scheduler without the knob (naming the preset).
    """
    import lightkv

    if isinstance(preset, str) and preset in VARIANTS:
        from dataclasses import replace

        base, changes = VARIANTS[preset]
        preset = replace(lightkv.load(base), name=preset, **changes)
    pipe = lightkv.load(preset) if isinstance(preset, str) else preset
    try:
        fitted = pipe.at_kept_fraction(target).resolved(num_layers)
    except KeptFractionOutOfReach as e:
        return pipe.at_kept_fraction(e.nearest).resolved(num_layers), "nearest"
    except ScheduleError as e:  # a plugin scheduler without the knob
        raise ValueError(f"preset {pipe.name!r} cannot be put at a kept fraction: {e}") from None
    modes = {s.mode for s in fitted.plan(num_layers)}
    if modes <= {"cache"}:  # cache stages, or a mode alone (H2O)
        return fitted, "cache"
    if "pre_llm" in modes:
        return fitted, "before the LLM" if modes == {"pre_llm"} else "before the LLM and later"
    return fitted, "scaled"
