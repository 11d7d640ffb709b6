"""`KeptFractionSchedule` (``kept_fraction``): a target kept fraction on a model of any depth."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ..base import removed_names
from .core import (
    ScheduleError,
    Scheduler,
    StageSpec,
    average_kept_fraction,
    check_fraction,
    check_windows,
    ratio_for_target,
)
from .explicit import _as_list, _nullable, _one_or_list
from .knob import REACH_TOLERANCE, check_target, out_of_reach

__all__ = ["KeptFractionSchedule"]


@Scheduler.register("kept_fraction")
@removed_names(target="kept_fraction", max_ratio="max_removal_ratio")
@dataclass
class KeptFractionSchedule(Scheduler):
    """Hit a target vision-KV fraction (averaged over layers) on a model of any depth.

    Stages sit at the same relative depths as the reference LLaVA schedule (12/32, 18/32,
    24/32 by default) and one common ratio ``P <= max_removal_ratio`` is found by bisection so
    that `average_kept_fraction` equals ``kept_fraction``. If even ``max_removal_ratio`` at
    those depths keeps too much, all stages move earlier by the same number of layers
    (keeping their spacing) until the target is reachable: compressing earlier is the only
    other way to keep less.

    Attributes:
        kept_fraction: the target kept fraction in ``(0, 1]``.
        relative_layers: stage positions as fractions of depth.
        windows_per_side: windows per side per stage.
        max_removal_ratio: the largest removal a stage can really make. With a parity split only
            side A (half of each window) can leave, so ratios above 0.5 remove no more than
            0.5; raise it for partitioners with more sources (e.g. ``all_src``).

    Raises:
        ScheduleError: at construction, for a value out of range or windows that do not
            give one entry per relative layer.
    """

    kept_fraction: float = 0.55
    relative_layers: tuple[float, ...] = (12 / 32, 18 / 32, 24 / 32)
    windows_per_side: tuple[int, ...] = (4, 2, 1)
    max_removal_ratio: float = 0.5

    def __post_init__(self) -> None:
        self._check()

    shorthand: ClassVar[str] = "kept_fraction"
    shorthand_keys: ClassVar[tuple[str, ...]] = (
        "relative_layers",
        "windows_per_side",
        "max_removal_ratio",
    )

    @classmethod
    def from_shorthand(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``kept_fraction: 0.55`` with optional ``relative_layers``, ``windows_per_side``
        (one value is broadcast; none: 4/2/1 at the default relative layers, otherwise one
        window per side) and ``max_removal_ratio``."""
        params: dict[str, Any] = {"kept_fraction": data["kept_fraction"]}
        rel = _as_list(data.get("relative_layers"))
        if rel is not None:
            params["relative_layers"] = rel
        n = len(rel) if isinstance(rel, list) else len(cls.relative_layers)
        if "windows_per_side" in data:
            wps = _as_list(data["windows_per_side"])
            if isinstance(wps, list) and len(wps) == 1:
                wps = wps * n
            elif isinstance(wps, list) and len(wps) != n:
                raise ScheduleError(
                    f"windows_per_side has {len(wps)} entries for {n} relative layers; "
                    f"give 1 or {n}",
                    "windows_per_side",
                )
            params["windows_per_side"] = wps
        elif isinstance(rel, list):
            params["windows_per_side"] = [1] * n
        if "max_removal_ratio" in data:
            params["max_removal_ratio"] = data["max_removal_ratio"]
        return params

    def to_shorthand(self) -> dict[str, Any]:
        default: dict[str, Any] = type(self).__dataclass_fields__  # fields with plain defaults
        rel_default = tuple(self.relative_layers) == tuple(default["relative_layers"].default)
        out: dict[str, Any] = {"kept_fraction": float(self.kept_fraction)}
        if not rel_default:
            out["relative_layers"] = [float(f) for f in self.relative_layers]
        implied = (
            tuple(default["windows_per_side"].default)
            if rel_default
            else (1,) * len(self.relative_layers)
        )
        if tuple(self.windows_per_side) != implied:
            out["windows_per_side"] = list(self.windows_per_side)
        if self.max_removal_ratio != default["max_removal_ratio"].default:
            out["max_removal_ratio"] = float(self.max_removal_ratio)
        return out

    @classmethod
    def shorthand_schema(cls) -> dict[str, Any]:
        number = {"type": "number"}
        return {
            "type": "object",
            "title": "a kept-fraction target "
            "(shorthand of name: kept_fraction, params: {kept_fraction: ...})",
            "properties": {
                "kept_fraction": number,
                "relative_layers": _nullable(_one_or_list(number)),
                "windows_per_side": _nullable(_one_or_list({"type": "integer"})),
                "max_removal_ratio": _nullable(number),
            },
            "required": ["kept_fraction"],
            "additionalProperties": False,
        }

    def max_stages(self) -> int:
        return len(self.relative_layers)

    def target_kept_fraction(self, num_layers: int) -> float:
        return float(self.kept_fraction)

    def _check(self) -> None:
        check_fraction(self.kept_fraction, "kept_fraction", True, False, "target kept fraction")
        check_fraction(self.max_removal_ratio, "max_removal_ratio", True, True, "max_removal_ratio")
        if not self.relative_layers:
            raise ScheduleError(
                "give at least one relative layer, e.g. [0.375, 0.5625, 0.75]", "relative_layers"
            )
        for i, f in enumerate(self.relative_layers):
            if not 0.0 <= float(f) <= 1.0:
                raise ScheduleError(
                    f"relative layers are fractions of depth in [0, 1], got {f!r}",
                    "relative_layers",
                    i,
                )
        check_windows(self.windows_per_side, None)
        n, k = len(self.relative_layers), len(self.windows_per_side)
        if k != n:
            raise ScheduleError(
                f"windows_per_side has {k} entries for {n} relative layers; "
                "give one per relative layer",
                "windows_per_side",
            )

    def _base(self, num_layers: int) -> list[int]:
        """The stages' layers on ``num_layers`` layers, before any move."""
        return sorted({min(num_layers - 1, round(f * num_layers)) for f in self.relative_layers})

    def _make(self, num_layers: int, p: float, shift: int = 0) -> list[StageSpec]:
        return [
            StageSpec(at - shift, p, windows_per_side=w)
            for at, w in zip(self._base(num_layers), self.windows_per_side)
        ]

    def lowest_kept_fraction(self, num_layers: int) -> float:
        """The least this schedule can keep on ``num_layers`` layers: its stages moved to
        start at layer 0, each at ``max_removal_ratio``."""
        self._check_depth(num_layers)
        first = self._base(num_layers)[0]
        return average_kept_fraction(
            self._make(num_layers, self.max_removal_ratio, first), num_layers
        )

    def at_kept_fraction(self, kept_fraction, num_layers, max_removal_ratio=1.0):
        """This schedule with ``kept_fraction`` as its target (its stages at their relative
        depths, moved earlier where needed, at its own ``max_removal_ratio``); a target
        below `lowest_kept_fraction` by at most `REACH_TOLERANCE` runs at that fraction.

        Raises:
            KeptFractionOutOfReach: a target further below `lowest_kept_fraction`.
        """
        t = check_target(kept_fraction)
        lowest = self.lowest_kept_fraction(num_layers)
        if lowest > t + REACH_TOLERANCE:
            how = (
                "its stages moved to start at layer 0 (removal ratio at most "
                f"{self.max_removal_ratio:g} each, its max_removal_ratio)"
            )
            raise out_of_reach(t, lowest, num_layers, how)
        return replace(self, kept_fraction=max(t, lowest))

    def knob(self) -> str:
        return (
            "its target kept_fraction: one common ratio of its stages at relative depths "
            f"{', '.join(f'{f:.3g}' for f in self.relative_layers)}, moved earlier where they "
            "cannot reach it"
        )

    def plan(self, num_layers):
        self._check_depth(num_layers)
        self._check()
        base = self._base(num_layers)

        def kept(p: float, shift: int = 0) -> float:
            return average_kept_fraction(self._make(num_layers, p, shift), num_layers)

        # Too little removal at these depths even at max_removal_ratio: move every stage earlier by
        # the same number of layers (keeping their spacing) until the target is reachable.
        shift = next(
            (
                t
                for t in range(base[0] + 1)
                if kept(self.max_removal_ratio, t) <= self.kept_fraction
            ),
            None,
        )
        if shift is None:
            raise ValueError(
                f"kept fraction {self.kept_fraction} is out of reach on {num_layers} layers: "
                f"starting at layer 0 with ratio {self.max_removal_ratio} per stage still keeps "
                f"{kept(self.max_removal_ratio, base[0]):.3f}; add stages (relative_layers) or use "
                "a partitioner that removes more (max_removal_ratio)"
            )
        p = round(
            ratio_for_target(lambda r: kept(r, shift), self.kept_fraction, self.max_removal_ratio),
            6,
        )
        return self._validate([] if p == 0 else self._make(num_layers, p, shift), num_layers)
