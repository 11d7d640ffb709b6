"""Schedulers: at which decoder layers to compress, with which windows and ratios."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from ..graph.windows import check_window_spec
from .base import Policy

__all__ = [
    "ExplicitSchedule",
    "KeptFractionSchedule",
    "Scheduler",
    "StageSpec",
    "average_kept_fraction",
    "ratio_for_target",
]


@dataclass(frozen=True)
class StageSpec:
    """One scheduled stage.

    Attributes:
        layer: 0-based decoder layer after which the stage runs.
        ratio: removal ratio ``P`` in ``[0, 1)``.
        windows_per_side: windows per image side, or
        window_size: window ``(rows, cols)`` in tokens.
    """

    layer: int
    ratio: float
    windows_per_side: int | None = None
    window_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"stage layer must be a non-negative integer, got {self.layer!r}")
        if not (0.0 <= float(self.ratio) < 1.0):
            raise ValueError(f"stage ratio must be in [0, 1), got {self.ratio!r}")
        check_window_spec(self.windows_per_side, self.window_size)


class Scheduler(Policy):
    """Family: turns a model depth into a list of `StageSpec`. Override `plan`."""

    family: ClassVar[str] = "scheduler"

    def plan(self, num_layers: int) -> list[StageSpec]:
        """Stages for a decoder of ``num_layers`` layers, sorted by layer.

        Raises:
            ValueError: the schedule does not fit the model (a layer ``>= num_layers``).
        """
        raise NotImplementedError

    @staticmethod
    def _validate(stages: list[StageSpec], num_layers: int) -> list[StageSpec]:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        layers = [s.layer for s in stages]
        if layers != sorted(set(layers)):
            raise ValueError(f"stage layers must be strictly increasing, got {layers}")
        if layers and layers[-1] >= num_layers:
            raise ValueError(
                f"the schedule compresses after layer {layers[-1]}, but the model has only {num_layers} "
                f"layers (0..{num_layers - 1}); use layers below {num_layers} or a kept_fraction schedule"
            )
        return stages


@Scheduler.register("explicit")
@dataclass
class ExplicitSchedule(Scheduler):
    """Fixed layers, windows and ratios (the reference code's schedules).

    Attributes:
        layers: 0-based layers Λ, increasing.
        ratios: removal ratio per stage (one value is broadcast).
        windows_per_side: windows per side per stage (one value is broadcast); the default
            ``(4, 2, 1)`` fits the three default layers only (other layers must give their
            own), or
        window_size: one ``(rows, cols)`` per stage (one value is broadcast); replaces the
            default ``windows_per_side``.

    Raises:
        ValueError: at construction, for lengths that do not match ``layers`` or bad values.
    """

    layers: tuple[int, ...] = (12, 18, 24)
    ratios: tuple[float, ...] = (0.5,)
    windows_per_side: tuple[int, ...] | None = (4, 2, 1)
    window_size: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        # The default (4, 2, 1) belongs to the three default layers: say so at construction,
        # not as a length mismatch at apply(); an explicit window_size replaces it.
        n = len(tuple(self.layers))
        if tuple(self.windows_per_side or ()) == (4, 2, 1):
            if self.window_size is not None:
                self.windows_per_side = None
            elif n != 3:
                raise ValueError(
                    f"ExplicitSchedule(layers={tuple(self.layers)}): windows_per_side defaults to (4, 2, 1), one entry "
                    f"per default layer; give windows_per_side with 1 or {n} entries (e.g. windows_per_side=(1,)) "
                    "or window_size"
                )
        self.stages()  # any other length or value problem, at construction too

    def stages(self) -> list[StageSpec]:
        """The stages, independent of depth (not yet checked against a model)."""
        n = len(self.layers)

        def per_stage(values, name):
            values = tuple(values)
            if len(values) == 1:
                return values * n
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} layers; give 1 or {n}")
            return values

        ratios = per_stage(self.ratios, "ratios")
        if self.windows_per_side is not None and self.window_size is not None:
            raise ValueError("give windows_per_side or window_size, not both")
        if self.window_size is not None:
            sizes = per_stage([tuple(s) for s in self.window_size], "window_size")
            return [StageSpec(int(at), float(r), window_size=s) for at, r, s in zip(self.layers, ratios, sizes)]
        wps = per_stage(self.windows_per_side or (1,), "windows_per_side")
        return [StageSpec(int(at), float(r), windows_per_side=int(w)) for at, r, w in zip(self.layers, ratios, wps)]

    def plan(self, num_layers):
        return self._validate(self.stages(), num_layers)


def average_kept_fraction(stages: list[StageSpec], num_layers: int) -> float:
    """Kept vision fraction averaged over layers, ignoring rounding.

    A layer at or before the first stage keeps everything (compression happens after the
    layer has cached its keys/values); later layers keep ``prod(1 - P)`` of the stages
    before them.
    """
    total, kept, start = 0.0, 1.0, 0
    for s in stages:
        total += (s.layer + 1 - start) * kept
        kept *= 1.0 - s.ratio
        start = s.layer + 1
    total += (num_layers - start) * kept
    return total / num_layers


def ratio_for_target(kept: Callable[[float], float], target: float, max_ratio: float) -> float:
    """The smallest common ratio ``p <= max_ratio`` with ``kept(p) <= target``, by bisection.

    ``kept`` maps a ratio to the kept fraction it gives (non-increasing, e.g.
    `average_kept_fraction` of fixed stages); returns ``max_ratio`` when even that keeps more.
    """
    lo, hi = 0.0, max_ratio
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if kept(mid) > target else (lo, mid)
    return hi


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
    """

    target: float = 0.55
    relative_layers: tuple[float, ...] = (12 / 32, 18 / 32, 24 / 32)
    windows_per_side: tuple[int, ...] = (4, 2, 1)
    max_ratio: float = 0.5

    def plan(self, num_layers):
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"target kept fraction must be in (0, 1], got {self.target!r}")
        if not 0.0 < self.max_ratio < 1.0:
            raise ValueError(f"max_ratio must be in (0, 1), got {self.max_ratio!r}")
        if len(self.windows_per_side) != len(self.relative_layers):
            raise ValueError("windows_per_side needs one entry per relative layer")

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
