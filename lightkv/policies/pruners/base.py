"""The pruner family: `Pruner` (rank A tokens by a removal key, remove the lowest per
window within the budget) and `PruneInputs`, what a pruner may look at."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ...graph.bipartite import BipartiteGraph
from ..base import Policy
from ..inputs import StageInputs

__all__ = ["Pruner", "PruneInputs"]


@dataclass(frozen=True)
class PruneInputs:
    """What a pruner may look at, all as dense per-window blocks ``[K, a_max]`` over A slots.

    Attributes:
        graph: the batched graph.
        divergence: divergence of each A token to its best partner (``+inf`` if none).
        relevance: prompt relevance ξ of each A token.
        identity: int64 identity of each A token, independent of the rest of the batch
            (see `lightkv.policies.hashing.token_identity`), for random policies.
        stage: the stage's `StageInputs` (features, sizes, layout) for pruners that need
            more; ``graph.token_blocks(t, "src")`` turns a ``[B, N, ...]`` tensor into
            A-slot blocks. None when a pruner is called on its own.
    """

    graph: BipartiteGraph
    divergence: torch.Tensor
    relevance: torch.Tensor
    identity: torch.Tensor
    stage: StageInputs | None = None


class Pruner(Policy):
    """Family: ranks A tokens for removal. Override `key`."""

    family: ClassVar[str] = "pruner"
    needs_partner: ClassVar[bool] = True
    """Removed tokens are merged into their best B partner, so a window needs B tokens."""

    def max_removal_ratio(self) -> float:
        """The largest share of a window this pruner removes, whatever the ratio: 0.5 with
        ``cap == "half"``, else no limit of its own (1.0; the partition's sides bound it,
        `lightkv.policies.Partitioner.max_removal_ratio`)."""
        return 0.5 if getattr(self, "cap", "sources") == "half" else 1.0

    def key(self, inputs: PruneInputs) -> torch.Tensor:
        """Removal key per A slot: ``[K, a_max]``; the lowest keys are removed first.
        Ties go to the earlier token."""
        raise NotImplementedError

    def budget(self, graph: BipartiteGraph, ratio: float) -> torch.Tensor:
        """``[K]`` tokens to remove per window: ``min(floor(ratio * n_w), |A_w|)``, or with
        ``cap == "half"`` ``min(floor(ratio * n_w), |A_w|, floor(n_w / 2))``. With
        ``budget_dtype == "float32"`` the product ``ratio * n_w`` is rounded to float32
        before it is truncated (the released code's ``(P * counts).long()``), which can
        remove one more: 0.35 * 180 is 62.99999999999999 in float64 but 63.0 in float32."""
        precision = getattr(self, "budget_dtype", "float64")
        if precision == "float32":
            r = (torch.tensor(ratio, dtype=torch.float32) * graph.window_size.float()).long()
        elif precision == "float64":
            r = torch.floor(graph.window_size.double() * ratio).long()
        else:
            raise ValueError(
                f"unknown budget_dtype {precision!r}; choose 'float64' (exact floor) or 'float32' "
                "(the released code's truncated float32 product)"
            )
        r = torch.minimum(r, graph.src_count)
        cap = getattr(self, "cap", "sources")
        if cap == "half":
            r = torch.minimum(r, torch.div(graph.window_size, 2, rounding_mode="floor"))
        elif cap != "sources":
            raise ValueError(
                f"unknown cap {cap!r}; choose 'sources' (|A| per window) or 'half' "
                "(floor(n/2), reference code)"
            )
        if self.needs_partner:
            r = torch.where(graph.dst_count > 0, r, torch.zeros_like(r))
        return r

    def select(self, inputs: PruneInputs, ratio: float) -> torch.Tensor:
        """``[K, a_max]`` bool: the A slots to remove."""
        return self.remove_lowest(inputs, self.budget(inputs.graph, ratio))

    def choose(self, inputs: PruneInputs, ratio: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(removed, zeroed)``: `select`'s slots to remove, and ``[K, a_max]`` bool slots that
        stay but as zero vectors (a method's padding: HoloV's code pads an image whose crops
        cannot fill its budget), or None. What a `lightkv.Stage` calls."""
        return self.select(inputs, ratio), None

    def remove_lowest(self, inputs: PruneInputs, count: torch.Tensor) -> torch.Tensor:
        """``[K, a_max]`` bool: in each window, the ``count[k]`` A slots with the lowest
        `key` (ties: the earlier token)."""
        graph = inputs.graph
        key = self.key(inputs).to(torch.float64)
        key = key.masked_fill(graph.src_slots < 0, math.inf)
        order = torch.sort(key, dim=1, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
        return (rank < count.unsqueeze(1)) & (graph.src_slots >= 0)
