"""The cache mode: compress a layer's cached keys and values after prefill (`CacheSchedule`,
``cache``), or evict cache entries during decoding (`H2OSchedule`, ``h2o``).

Both leave the prefill itself unchanged (every layer runs on, and first caches, the whole
prompt); only the KV cache that decoding reads gets smaller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..base import removed_names
from .core import ScheduleError, Scheduler, StageSpec, check_fraction, check_windows

__all__ = ["CacheSchedule", "H2OSchedule"]


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
            f"the schedule compresses the cache of layer {out[-1]}, but the model has only {num_layers} layers"
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


@Scheduler.register("h2o")
@dataclass
class H2OSchedule(Scheduler):
    """Heavy-hitter eviction (H2O, Zhang et al., NeurIPS 2023, arXiv:2306.14048), per layer.

    After the prefill and after every decoding step, each listed layer keeps, per batch
    row, the ``recent`` most recent candidate entries plus the ``heavy`` candidates with the
    largest attention accumulated so far (over the prompt's queries, then every decoded
    token's), and evicts the other candidates (`lightkv.policies.h2o_keep`). Evicted entries
    never come back. The budget is fixed at prefill: ``floor(budget * n)`` entries for the
    ``n`` candidate tokens of the row's prompt, ``floor(recent_share * that)`` of them recent.

    Attributes:
        budget: kept candidates as a fraction of the prompt's (may exceed 1: room for
            generated tokens before eviction starts).
        recent_share: the share of the budget that goes to the most recent candidates.
        tokens: ``vision`` (only vision tokens are candidates; text, structural and
            generated tokens always stay, so eviction happens once, after prefill) or
            ``all`` (every token is a candidate, the paper's setting: the cache stays at
            the budget while decoding, one eviction per step).
        layers: the layers that evict (None: every layer).
    """

    budget: float = 0.5
    recent_share: float = 0.5
    tokens: Literal["vision", "all"] = "vision"
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not float(self.budget) > 0.0:
            raise ScheduleError(f"budget must be > 0, got {self.budget!r}", "budget")
        check_fraction(self.recent_share, "recent_share", False, False, "recent share")
        if self.tokens not in ("vision", "all"):
            raise ScheduleError(f"tokens must be 'vision' or 'all', got {self.tokens!r}", "tokens")
        self.layers = _check_layers(self.layers)

    def max_stages(self) -> int:
        return 0

    def target_kept_fraction(self, num_layers: int) -> float | None:
        """Each evicting layer keeps ``min(budget, 1)`` of its candidates, the others all."""
        try:
            at = len(_layers(self.layers, num_layers, "h2o"))
        except ValueError:
            return None
        return (
            (at * min(float(self.budget), 1.0) + num_layers - at) / num_layers
            if num_layers
            else None
        )

    def plan(self, num_layers):
        """No stage runs on hidden states or through the graph machinery: eviction is the
        session's (see `evict_layers`)."""
        self._check_depth(num_layers)
        _layers(self.layers, num_layers, "h2o")
        return []

    def modes(self, num_layers: int) -> list[str]:
        """The ``h2o`` session mode (`lightkv.adapters.modes.h2o`), which reads this schedule."""
        self.plan(num_layers)
        return ["h2o"]

    def evict_layers(self, num_layers: int) -> list[int]:
        """The layers that evict, for a decoder of ``num_layers`` layers."""
        return _layers(self.layers, num_layers, "h2o")

    def counts(self, candidates):
        """``(heavy, recent)`` ``[B]`` int64 from the prompt's candidate counts ``[B]``."""
        total = (candidates.double() * float(self.budget) + 1e-9).floor().long()
        recent = (total.double() * float(self.recent_share) + 1e-9).floor().long()
        return total - recent, recent
