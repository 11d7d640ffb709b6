"""Pruners: which tokens leave the sequence at a stage.

A pruner ranks the A tokens of every window by a removal key (lower leaves first) and
removes the ``r`` lowest per window. The budget is LightKV's
``r = min(floor(P * n_w), |A_w|)``, where ``n_w`` counts the window's A and B tokens; for
pruners that merge into a partner (``needs_partner``), a window without B tokens removes
nothing. The divergence pruners can instead cap at ``floor(n_w / 2)`` (``cap: half``), the
reference code's rule: with a parity split ``|A_w| = ceil(n_w / 2)``, so the two differ only
for odd windows at ``P > 0.5`` (288 tokens at P = 0.75: 145 left with ``sources``, 143 with
``half``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..graph.bipartite import BipartiteGraph
from .base import Policy
from .hashing import seeded_uniform
from .inputs import StageInputs

__all__ = [
    "Pruner",
    "PruneInputs",
    "SmallestDivergence",
    "RelevanceAwareDivergence",
    "LowestRelevance",
    "RandomPruner",
]


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
            more; ``graph.blocks(graph.gather(t), "src")`` turns a ``[B, N, ...]`` tensor
            into A-slot blocks. None when a pruner is called on its own.
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

    def key(self, inputs: PruneInputs) -> torch.Tensor:
        """Removal key per A slot: ``[K, a_max]``; the lowest keys are removed first.
        Ties go to the earlier token."""
        raise NotImplementedError

    def budget(self, graph: BipartiteGraph, ratio: float) -> torch.Tensor:
        """``[K]`` tokens to remove per window: ``min(floor(ratio * n_w), |A_w|)``, or with
        ``cap == "half"`` ``min(floor(ratio * n_w), |A_w|, floor(n_w / 2))``."""
        n = graph.window_size.double()
        r = torch.floor(n * ratio).long()
        r = torch.minimum(r, graph.src_count)
        cap = getattr(self, "cap", "sources")
        if cap == "half":
            r = torch.minimum(r, torch.div(graph.window_size, 2, rounding_mode="floor"))
        elif cap != "sources":
            raise ValueError(f"unknown cap {cap!r}; choose 'sources' (|A| per window) or 'half' (floor(n/2), reference code)")
        if self.needs_partner:
            r = torch.where(graph.dst_count > 0, r, torch.zeros_like(r))
        return r

    def select(self, inputs: PruneInputs, ratio: float) -> torch.Tensor:
        """``[K, a_max]`` bool: the A slots to remove."""
        graph = inputs.graph
        key = self.key(inputs).to(torch.float64)
        key = key.masked_fill(graph.src_slots < 0, math.inf)
        order = torch.sort(key, dim=1, stable=True).indices
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
        return (rank < self.budget(graph, ratio).unsqueeze(1)) & (graph.src_slots >= 0)


@Pruner.register("divergence")
@dataclass
class SmallestDivergence(Pruner):
    """Remove the A tokens closest to their best partner.

    LightKV's candidate set (Chen, Guo, Zimmermann, TMLR 2026, arXiv:2605.00789) and
    ToMe's bipartite soft matching (Bolya et al., ICLR 2023, arXiv:2210.09461).

    Attributes:
        cap: the most a window loses: ``sources`` (all of side A) or ``half``
            (``floor(n_w / 2)``, the reference code's cap).
    """

    cap: Literal["sources", "half"] = "sources"

    def key(self, inputs):
        return inputs.divergence


@Pruner.register("relevance_divergence")
@dataclass
class RelevanceAwareDivergence(Pruner):
    """Remove tokens that are both redundant and irrelevant to the prompt.

    ``key = divergence + weight * relevance / max relevance in the window``: at equal
    divergence, the token the prompt cares less about leaves first.

    Attributes:
        weight: how much relevance counts next to divergence (0 = `SmallestDivergence`).
        cap: as `SmallestDivergence`.
    """

    weight: float = 0.5
    cap: Literal["sources", "half"] = "sources"

    def key(self, inputs):
        xi = inputs.relevance.to(torch.float64)
        top = xi.max(dim=1, keepdim=True).values.clamp_min(1e-30)
        return inputs.divergence.to(torch.float64) + self.weight * xi / top


@Pruner.register("lowest_relevance")
@dataclass
class LowestRelevance(Pruner):
    """Remove the tokens with the lowest prompt relevance (attention top-k).

    FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2", ECCV 2024,
    arXiv:2403.06764) and PyramidDrop (Xing et al., CVPR 2025, arXiv:2410.17247). Needs no
    partner: combine with the ``drop`` message passer.
    """

    needs_partner: ClassVar[bool] = False

    def key(self, inputs):
        return inputs.relevance


@Pruner.register("random")
@dataclass
class RandomPruner(Pruner):
    """Remove tokens at random: a deterministic hash of each token's grid position and
    ``seed``, so a row gets the same result alone or inside a batch.

    Attributes:
        seed: changes the draw.
    """

    needs_partner: ClassVar[bool] = False
    seed: int = 0

    def key(self, inputs):
        return seeded_uniform(inputs.identity, self.seed)
