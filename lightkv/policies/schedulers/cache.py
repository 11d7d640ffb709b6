"""`CacheSchedule` (``cache``): compress a layer's cached keys and values after its prefill.

The prefill itself is unchanged (every layer runs on, and first caches, the whole prompt);
only the KV cache that decoding reads gets smaller. Eviction during decoding (H2O) plans no
stage: it is a mode of its own (`lightkv.adapters.modes.h2o.H2OMode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..base import removed_names
from .core import ScheduleError, Scheduler, StageSpec, check_fraction, check_windows

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
