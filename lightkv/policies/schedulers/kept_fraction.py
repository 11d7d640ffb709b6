"""`KeptFractionSchedule` (``kept_fraction``): a target kept fraction on a model of any depth."""

from __future__ import annotations

from dataclasses import dataclass

from .core import (
    ScheduleError,
    Scheduler,
    StageSpec,
    average_kept_fraction,
    check_fraction,
    check_windows,
    ratio_for_target,
)

__all__ = ["KeptFractionSchedule"]


@Scheduler.register("kept_fraction")
@dataclass
class KeptFractionSchedule(Scheduler):
    """Hit a target vision-KV fraction (averaged over layers) on a model of any depth.

    Stages sit at the same relative depths as the reference LLaVA schedule (12/32, 18/32,
    24/32 by default) and one common ratio ``P <= max_ratio`` is found by bisection so that
    `average_kept_fraction` equals ``target``. If even ``max_ratio`` at those depths keeps
    too much, all stages move earlier by the same number of layers (keeping their spacing)
    until the target is reachable: compressing earlier is the only other way to keep less.

    Attributes:
        target: kept fraction in ``(0, 1]``.
        relative_layers: stage positions as fractions of depth.
        windows_per_side: windows per side per stage.
        max_ratio: the largest removal a stage can really make. With a parity split only
            side A (half of each window) can leave, so ratios above 0.5 remove no more than
            0.5; raise it for partitioners with more sources (e.g. ``all_src``).

    Raises:
        ScheduleError: at construction, for a value out of range or windows that do not
            give one entry per relative layer.
    """

    target: float = 0.55
    relative_layers: tuple[float, ...] = (12 / 32, 18 / 32, 24 / 32)
    windows_per_side: tuple[int, ...] = (4, 2, 1)
    max_ratio: float = 0.5

    def __post_init__(self) -> None:
        self._check()

    def max_stages(self) -> int:
        return len(self.relative_layers)

    def target_kept_fraction(self, num_layers: int) -> float:
        return float(self.target)

    def _check(self) -> None:
        check_fraction(self.target, "target", True, False, "target kept fraction")
        check_fraction(self.max_ratio, "max_ratio", True, True, "max_ratio")
        if not self.relative_layers:
            raise ScheduleError("give at least one relative layer, e.g. [0.375, 0.5625, 0.75]", "relative_layers")
        for i, f in enumerate(self.relative_layers):
            if not 0.0 <= float(f) <= 1.0:
                raise ScheduleError(f"relative layers are fractions of depth in [0, 1], got {f!r}", "relative_layers", i)
        check_windows(self.windows_per_side, None)
        n, k = len(self.relative_layers), len(self.windows_per_side)
        if k != n:
            raise ScheduleError(
                f"windows_per_side has {k} entries for {n} relative layers; give one per relative layer",
                "windows_per_side",
            )

    def plan(self, num_layers):
        self._check_depth(num_layers)
        self._check()
        base = sorted({min(num_layers - 1, round(f * num_layers)) for f in self.relative_layers})

        def make(p: float, shift: int = 0) -> list[StageSpec]:
            return [StageSpec(at - shift, p, windows_per_side=w) for at, w in zip(base, self.windows_per_side)]

        def kept(p: float, shift: int = 0) -> float:
            return average_kept_fraction(make(p, shift), num_layers)

        # Too little removal at these depths even at max_ratio: move every stage earlier by
        # the same number of layers (keeping their spacing) until the target is reachable.
        shift = next((t for t in range(base[0] + 1) if kept(self.max_ratio, t) <= self.target), None)
        if shift is None:
            raise ValueError(
                f"kept fraction {self.target} is out of reach on {num_layers} layers: starting at layer 0 "
                f"with ratio {self.max_ratio} per stage still keeps {kept(self.max_ratio, base[0]):.3f}; "
                "add stages (relative_layers) or use a partitioner that removes more (max_ratio)"
            )
        p = round(ratio_for_target(lambda r: kept(r, shift), self.target, self.max_ratio), 6)
        return self._validate([] if p == 0 else make(p, shift), num_layers)
