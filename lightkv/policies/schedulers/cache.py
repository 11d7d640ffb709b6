"""`CacheSchedule` (``cache``): compress a layer's cached keys and values after its prefill.

The prefill itself is unchanged (every layer runs on, and first caches, the whole prompt);
only the KV cache that decoding reads gets smaller. Eviction during decoding (H2O) plans no
stage: it is a mode of its own (`lightkv.adapters.modes.h2o.H2OMode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..base import removed_names
from .core import ScheduleError, Scheduler, StageSpec, check_fraction, check_windows
from .knob import REACH_TOLERANCE, check_target, out_of_reach, stage_cap

__all__ = ["CacheSchedule"]


def _layers(layers: Sequence[int] | None, num_layers: int, who: str) -> list[int]:
    if layers is None:
        return list(range(num_layers))
    out = [int(layer) for layer in layers]
    if out != sorted(set(out)) or (out and out[0] < 0):
        raise ScheduleError(
            f"{who} layers must be strictly increasing and >= 0, got {out}", "layers"
        )
    if out and out[-1] >= num_layers:
        raise ValueError(
            f"the schedule compresses the cache of layer {out[-1]}, "
            f"but the model has only {num_layers} layers"
        )
    return out


def _check_layers(layers) -> tuple[int, ...] | None:
    if layers is None:
        return None
    if len(layers) == 0:  # accepted before and compressed nothing, silently
        raise ScheduleError(
            "layers is empty, so nothing would be compressed: list the layers whose caches to "
            "compress, or leave layers out for every layer",
            "layers",
        )
    for i, layer in enumerate(layers):
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ScheduleError(
                f"a layer must be a non-negative integer, got {layer!r}", "layers", i
            )
    return tuple(layers)


@Scheduler.register("cache")
@removed_names(ratio="removal_ratio")
@dataclass
class CacheSchedule(Scheduler):
    """One cache stage per listed layer (every layer by default), run on the layer's cached
    keys and values right after the layer's prefill (`lightkv.cache_stage.CacheStage`).

    Attributes:
        removal_ratio: removal ratio in ``[0, 1)`` of each stage (what the stage's pruner removes
            of each window).
        layers: the layers whose caches are compressed (None: every layer).
        windows_per_side: windows per image side, for window partitioners (``grid``);
            ``importance`` and ``global`` ignore it.
    """

    removal_ratio: float = 0.5
    layers: tuple[int, ...] | None = None
    windows_per_side: int = 1

    def __post_init__(self) -> None:
        check_fraction(self.removal_ratio, "removal_ratio", False, True, "removal ratio")
        self.layers = _check_layers(self.layers)
        check_windows([self.windows_per_side], None)

    def plan(self, num_layers):
        self._check_depth(num_layers)
        at = _layers(self.layers, num_layers, "cache")
        return self._validate(
            [
                StageSpec(layer, float(self.removal_ratio), self.windows_per_side, mode="cache")
                for layer in at
            ],
            num_layers,
        )

    def at_kept_fraction(self, kept_fraction, num_layers, max_removal_ratio=1.0):
        """The same cache stages with the removal ratio that keeps ``kept_fraction`` on
        average: ``1 - kept_fraction`` on every layer, more where only some layers are listed
        (rounded to 6 decimals).

        Raises:
            KeptFractionOutOfReach: a ratio beyond the stages' limit by more than
                `REACH_TOLERANCE` of kept fraction (e.g. too few listed layers).
        """
        t = check_target(kept_fraction)
        stages = self.plan(num_layers)
        limit = min(stage_cap(max_removal_ratio, i, s) for i, s in enumerate(stages))
        ratio = (1.0 - t) * num_layers / len(stages)
        if ratio > limit:
            lowest = 1.0 - limit * len(stages) / num_layers
            if lowest > t + REACH_TOLERANCE:
                how = f"its {len(stages)} cache stage(s) (removal ratio at most {limit:g} each)"
                raise out_of_reach(t, lowest, num_layers, how)
            ratio = limit
        return replace(self, removal_ratio=round(ratio, 6))

    def knob(self) -> str:
        return "the removal ratio of each compressed layer's cache stage"
