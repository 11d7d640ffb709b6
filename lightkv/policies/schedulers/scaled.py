"""`ScaledSchedule` (``scaled``): an explicit schedule written for one depth, moved to another."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..base import removed_names
from .core import ScheduleError, Scheduler
from .explicit import ExplicitSchedule

__all__ = ["ScaledSchedule", "scale_layers"]


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


def reference_layers(layers: Sequence[int], ref_depth: int, num_layers: int) -> tuple[int, ...]:
    """``layers`` of a ``ref_depth``-layer schedule on ``num_layers`` layers: as written at the
    reference depth, otherwise moved with `scale_layers`."""
    return tuple(layers) if num_layers == ref_depth else scale_layers(layers, ref_depth, num_layers)


def check_reference(scheduler, ratios) -> None:
    """Check the reference layers and windows of a depth-scaled scheduler at its reference depth.

    Raises:
        ScheduleError: a bad ``ref_depth``, or stages that do not fit it.
    """
    if (
        isinstance(scheduler.ref_depth, bool)
        or not isinstance(scheduler.ref_depth, int)
        or scheduler.ref_depth < 2
    ):
        raise ScheduleError(
            f"ref_depth must be an integer >= 2, got {scheduler.ref_depth!r}", "ref_depth"
        )
    ref = ExplicitSchedule(
        layers=tuple(scheduler.layers),
        removal_ratios=tuple(ratios),
        windows_per_side=scheduler.windows_per_side,
        window_size=scheduler.window_size,
    )
    try:
        ref.plan(scheduler.ref_depth)
    except ScheduleError:
        raise
    except ValueError as e:
        raise ScheduleError(
            f"{e} (the layers are written for ref_depth={scheduler.ref_depth})", "layers"
        ) from None


@Scheduler.register("scaled")
@removed_names(ratios="removal_ratios")
@dataclass
class ScaledSchedule(Scheduler):
    """An explicit schedule written for a ``ref_depth``-layer decoder, on a model of any depth.

    On a model of ``ref_depth`` layers it is the explicit schedule as written; on any other
    depth its layers are moved with `scale_layers` (each stage keeps about the same share
    of the layers uncompressed), while ratios and windows stay per stage. This is how the
    benchmarks run the reference 32-layer schedules on reduced decoders: LLaVA's 12/18/24
    of 32 becomes 2/4/5 of 8.

    Attributes:
        layers: 0-based layers of the reference schedule, increasing, below ``ref_depth``.
        ref_depth: the depth ``layers`` are written for.
        removal_ratios: removal ratio per stage (one value is broadcast).
        windows_per_side: windows per side per stage (one value is broadcast), or
        window_size: one ``(rows, cols)`` per stage; replaces the default ``windows_per_side``.

    Raises:
        ScheduleError: at construction, for the same problems as `ExplicitSchedule` or layers
            at or beyond ``ref_depth``.
    """

    layers: tuple[int, ...] = (12, 18, 24)
    ref_depth: int = 32
    removal_ratios: tuple[float, ...] = (0.5,)
    windows_per_side: tuple[int, ...] | None = (4, 2, 1)
    window_size: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if tuple(self.windows_per_side or ()) == (4, 2, 1) and self.window_size is not None:
            self.windows_per_side = None  # as in ExplicitSchedule: window_size replaces the default
        check_reference(self, self.removal_ratios)

    def max_stages(self) -> int:
        return len(self.layers)

    def explicit(self, num_layers: int) -> ExplicitSchedule:
        """The `ExplicitSchedule` this schedule is on a ``num_layers``-layer model.

        Raises:
            ValueError: the scaled stages do not fit ``num_layers`` layers.
        """
        return ExplicitSchedule(
            layers=reference_layers(self.layers, self.ref_depth, num_layers),
            removal_ratios=tuple(self.removal_ratios),
            windows_per_side=self.windows_per_side,
            window_size=self.window_size,
        )

    def plan(self, num_layers):
        self._check_depth(num_layers)
        return self.explicit(num_layers).plan(num_layers)
