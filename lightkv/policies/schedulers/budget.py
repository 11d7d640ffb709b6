"""`BudgetSchedule` (``budget``): a method's own stages, scaled to the model, at a
kept-fraction budget."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from ..base import removed_names
from .core import (
    ScheduleError,
    Scheduler,
    StageSpec,
    average_kept_fraction,
    check_fraction,
    ratio_for_target,
)
from .explicit import ExplicitSchedule
from .knob import REACH_TOLERANCE, check_target, out_of_reach
from .scaled import check_reference, reference_layers

__all__ = ["BudgetFit", "BudgetSchedule", "budget_schedule"]

BudgetFit = Literal["scaled", "extra stages", "min"]
"""How `budget_schedule` reached a target (not where stages run: that is a pipeline's
``placement``)."""


def budget_schedule(
    layers: Sequence[int],
    num_layers: int,
    kept_fraction: float,
    max_removal_ratio: float = 0.5,
    windows_per_side: Sequence[int] | None = None,
    window_size=None,
    tolerance: float = 0.02,
):
    """``(ExplicitSchedule, how)`` keeping about ``kept_fraction`` of the vision KV.

    Layer sets are tried in order: ``layers`` (already at the model's depth), then the same
    stages moved earlier by 1, 2, ... layers (spacing kept), then a stage after every layer
    but the last (the deepest compression a method with this per-stage ``max_removal_ratio``
    can make; per-stage windows repeat their last entry). The first layer set that can keep
    ``kept_fraction + tolerance`` or less gets one common ratio ``<= max_removal_ratio`` by
    bisection on `average_kept_fraction`. ``how`` is ``"scaled"`` (the method's own
    stages), ``"extra stages"`` (a stage after every layer) or ``"min"`` (out of reach: the
    deepest layer set at ``max_removal_ratio``). The tolerance keeps e.g. LightKV's own 0.5
    ratio at its scaled layers for a 55% target on 6 layers (56.25%) rather than moving it.

    Raises:
        ValueError: ``kept_fraction`` outside ``(0, 1]``.
    """
    if not 0.0 < kept_fraction <= 1.0:
        raise ValueError(f"kept_fraction must be in (0, 1], got {kept_fraction}")
    if kept_fraction >= 1.0:
        return ExplicitSchedule(layers=(), removal_ratios=(), windows_per_side=None), "scaled"
    layers = list(layers)
    fits = [(tuple(l - shift for l in layers), "scaled") for shift in range(layers[0] + 1)]
    fits.append((tuple(range(num_layers - 1)), "extra stages"))

    def kept(p: float, at: tuple[int, ...]) -> float:
        return average_kept_fraction([StageSpec(l, p, windows_per_side=1) for l in at], num_layers)

    def per_stage(values, n: int):
        values = [tuple(v) if isinstance(v, (list, tuple)) else v for v in values]
        return tuple(values[:n]) + (values[-1],) * max(0, n - len(values))

    def build(p: float, at: tuple[int, ...]):
        extra: dict[str, Any] = {"windows_per_side": None}
        if window_size is not None:
            extra["window_size"] = per_stage(window_size, len(at))
        elif windows_per_side is not None:
            extra["windows_per_side"] = per_stage(windows_per_side, len(at))
        return ExplicitSchedule(layers=at, removal_ratios=(p,), **extra)

    for at, how in fits:
        if kept(max_removal_ratio, at) <= kept_fraction + tolerance:
            return build(
                round(
                    ratio_for_target(
                        # mypy cannot infer a lambda with a default (`at` bound per loop step)
                        lambda p, at=at: kept(p, at),  # type: ignore[misc]
                        kept_fraction,
                        max_removal_ratio,
                    ),
                    4,
                ),
                at,
            ), how
    return build(max_removal_ratio, fits[-1][0]), "min"


@Scheduler.register("budget")
@removed_names(target="kept_fraction", max_ratio="max_removal_ratio")
@dataclass
class BudgetSchedule(Scheduler):
    """A method's own stages, written for ``ref_depth`` layers, at a kept-fraction budget.

    `plan` moves ``layers`` to the model's depth with `scale_layers` (as `ScaledSchedule`
    does), then places the stages with `budget_schedule`: at the scaled layers if one common
    ratio ``<= max_removal_ratio`` keeps ``kept_fraction + tolerance`` or less, else the same
    stages moved earlier, else a stage after every layer but the last; `fit` says
    which. (The kept-fraction knob, `Scheduler.at_kept_fraction`, keeps a method's own
    layers instead; the benchmarks use it.)

    Attributes:
        layers: 0-based layers of the method's reference schedule, below ``ref_depth``.
        ref_depth: the depth ``layers`` are written for.
        kept_fraction: vision-KV fraction to keep, averaged over layers, in ``(0, 1]``.
        max_removal_ratio: the largest removal a stage can really make, in ``(0, 1)`` (0.5 with a
            parity split, where only half of each window can leave).
        tolerance: how much above ``kept_fraction`` the method's own stages may keep before they
            are moved (>= 0).
        windows_per_side: windows per side per stage (one value is broadcast; extra stages
            repeat the last), or
        window_size: one ``(rows, cols)`` per stage; replaces the default ``windows_per_side``.

    Raises:
        ScheduleError: at construction, for a value out of range or reference stages that
            do not fit ``ref_depth``.
    """

    layers: tuple[int, ...] = (12, 18, 24)
    ref_depth: int = 32
    kept_fraction: float = 0.55
    max_removal_ratio: float = 0.5
    tolerance: float = 0.02
    windows_per_side: tuple[int, ...] | None = (4, 2, 1)
    window_size: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if tuple(self.windows_per_side or ()) == (4, 2, 1) and self.window_size is not None:
            self.windows_per_side = None
        check_fraction(self.kept_fraction, "kept_fraction", True, False, "target kept fraction")
        check_fraction(self.max_removal_ratio, "max_removal_ratio", True, True, "max_removal_ratio")
        if not float(self.tolerance) >= 0.0:
            raise ScheduleError(f"tolerance must be >= 0, got {self.tolerance!r}", "tolerance")
        if not self.layers:
            raise ScheduleError("give at least one reference layer, e.g. [12, 18, 24]", "layers")
        check_reference(self, (self.max_removal_ratio,))

    def _fitted(self, num_layers: int) -> tuple[ExplicitSchedule, BudgetFit]:
        layers = reference_layers(self.layers, self.ref_depth, num_layers)
        return budget_schedule(
            layers,
            num_layers,
            self.kept_fraction,
            self.max_removal_ratio,
            windows_per_side=self.windows_per_side,
            window_size=self.window_size,
            tolerance=self.tolerance,
        )

    def explicit(self, num_layers: int) -> ExplicitSchedule:
        """The `ExplicitSchedule` this schedule is on a ``num_layers``-layer model."""
        return self._fitted(num_layers)[0]

    def fit(self, num_layers: int) -> BudgetFit:
        """How `plan` reaches the target on ``num_layers`` layers: ``"scaled"`` (the method's
        own stages, possibly moved earlier), ``"extra stages"`` (a stage after every layer
        but the last) or ``"min"`` (the target is out of reach: the deepest layer set at
        ``max_removal_ratio``)."""
        return self._fitted(num_layers)[1]

    def target_kept_fraction(self, num_layers: int) -> float:
        return float(self.kept_fraction)

    def plan(self, num_layers):
        self._check_depth(num_layers)
        return self._fitted(num_layers)[0].plan(num_layers)

    def at_kept_fraction(self, kept_fraction, num_layers, max_removal_ratio=1.0):
        """This schedule with ``kept_fraction`` as its target: its stages placed as `plan`
        places them (moved earlier, or repeated, where its own cannot reach it), at its own
        ``max_removal_ratio``.

        Raises:
            KeptFractionOutOfReach: even its deepest layer set (`fit` ``"min"``) keeps more
                than ``kept_fraction + REACH_TOLERANCE``.
        """
        t = check_target(kept_fraction)
        self._check_depth(num_layers)
        out = replace(self, kept_fraction=t)
        if out.fit(num_layers) == "min":
            lowest = average_kept_fraction(out.plan(num_layers), num_layers)
            if lowest > t + REACH_TOLERANCE:
                how = (
                    "a stage after every layer but the last (removal ratio at most "
                    f"{self.max_removal_ratio:g}, its max_removal_ratio)"
                )
                raise out_of_reach(t, lowest, num_layers, how)
        return out

    def knob(self) -> str:
        return (
            "its target kept_fraction: its stages (layers "
            f"{', '.join(str(at) for at in self.layers)} of {self.ref_depth}, scaled) with one "
            "common ratio, moved earlier or repeated after every layer where they cannot reach it"
        )
