"""`ScaledSchedule` (``scaled``): an explicit schedule written for one depth, moved to another."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..base import removed_names
from .core import ScheduleError, Scheduler
from .explicit import ExplicitSchedule
from .knob import scale_layers

__all__ = ["ScaledSchedule"]


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

    def at_kept_fraction(self, kept_fraction, num_layers, max_removal_ratio=1.0):
        """Its stages at the model's depth (`explicit`) with one common removal ratio fitted
        to ``kept_fraction`` (`ExplicitSchedule.at_kept_fraction`)."""
        self._check_depth(num_layers)
        return self.explicit(num_layers).at_kept_fraction(
            kept_fraction, num_layers, max_removal_ratio
        )

    def knob(self) -> str:
        layers = ", ".join(str(at) for at in self.layers)
        return (
            f"one common removal ratio of its stages after layers {layers} of {self.ref_depth}, "
            "scaled to the model's depth"
        )
