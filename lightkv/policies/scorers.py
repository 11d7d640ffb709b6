"""Edge scorers: the divergence between A and B tokens of a window, and each A token's
best (least divergent) B partner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..graph.bipartite import BipartiteGraph
from .base import Policy
from .hashing import seeded_uniform
from .inputs import Features, StageInputs

__all__ = ["CosineDivergence", "EdgeScorer", "L2Divergence", "RandomDivergence"]


class EdgeScorer(Policy):
    """Family: how dissimilar two tokens are (lower = better merge partners).

    Override `divergence`; `best_edges` batches it over all windows at once. A scorer that
    needs more than two feature blocks (relevance, sizes, the layout) overrides `match`.

    Attributes:
        features: which per-token features to compare: ``"hidden"`` (the residual stream
            ``[D]`` per token, as LightKV) or ``"keys"`` (the layer's attention keys,
            ``[H_kv, d]`` per token, computed by the adapter when a scorer asks for them).
    """

    family: ClassVar[str] = "scorer"
    features: Features = "hidden"

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features}) - {"hidden"}

    def divergence(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Pairwise divergence inside each window.

        Args:
            src: ``[K, a, *F]`` features of the A tokens of ``K`` windows (zero padding):
                ``[K, a, D]`` for hidden states, ``[K, a, H_kv, d]`` for keys.
            dst: ``[K, b, *F]`` features of the B tokens.

        Returns:
            ``[K, a, b]`` divergences; padding entries are ignored by the caller.
        """
        raise NotImplementedError

    def match(self, inputs: StageInputs, graph: BipartiteGraph) -> tuple[torch.Tensor, torch.Tensor]:
        """Each A node's best partner for a stage: `best_edges` on ``inputs.features(self.features)``.

        Returns:
            ``(dst [K, a_max], divergence [K, a_max])`` as `best_edges`.
        """
        return self.best_edges(graph, graph.gather(inputs.features(self.features)))

    def best_edges(self, graph: BipartiteGraph, node_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each A node's least divergent B node in its window.

        Args:
            graph: the batched graph.
            node_features: ``[M, *F]`` per-node features.

        Returns:
            ``(dst [K, a_max], divergence [K, a_max])``: node index of the best partner
            (``-1`` where the slot is padding or the window has no B node) and its
            divergence (``+inf`` there). Ties go to the earliest B token.
        """
        feats = node_features.to(torch.promote_types(node_features.dtype, torch.float32))
        src = graph.blocks(feats, "src")
        dst = graph.blocks(feats, "dst")
        k, a = graph.src_slots.shape
        if graph.dst_slots.shape[1] == 0 or a == 0:
            return graph.src_slots.new_full((k, a), -1), feats.new_full((k, a), float("inf"))
        div = self.divergence(src, dst)
        if div.shape != (k, a, graph.dst_slots.shape[1]):
            raise ValueError(f"{type(self).__name__}.divergence returned {tuple(div.shape)}, expected {(k, a, graph.dst_slots.shape[1])}")
        div = div.masked_fill((graph.dst_slots < 0).unsqueeze(1), float("inf"))
        best_div, best_slot = div.min(dim=-1)
        best_dst = graph.dst_slots.gather(1, best_slot)
        invalid = (graph.src_slots < 0) | torch.isinf(best_div)
        return best_dst.masked_fill(invalid, -1), best_div.masked_fill(invalid, float("inf"))


@EdgeScorer.register("cosine")
@dataclass
class CosineDivergence(EdgeScorer):
    """Feature divergence ``FD(a, b) = 1 - cos(x_a, x_b)``.

    LightKV's edge weight (Chen, Guo, Zimmermann, TMLR 2026, arXiv:2605.00789); ToMe
    (Bolya et al., ICLR 2023) matches on the same cosine similarity.

    Attributes:
        features: ``"hidden"`` or ``"keys"``.
        eps: guards the norm of all-zero features.
    """

    features: Features = "hidden"
    eps: float = 1e-12

    def divergence(self, src, dst):
        src, dst = src.flatten(2), dst.flatten(2)  # keys: all heads of a token as one vector
        # Same as normalising src and dst first, without two normalised [K, *, D] copies.
        ns = src.norm(dim=-1).clamp_min(self.eps)
        nd = dst.norm(dim=-1).clamp_min(self.eps)
        return 1.0 - torch.bmm(src, dst.transpose(1, 2)) / (ns.unsqueeze(2) * nd.unsqueeze(1))


@EdgeScorer.register("l2")
@dataclass
class L2Divergence(EdgeScorer):
    """Euclidean distance ``||x_a - x_b||`` (sensitive to norms, unlike cosine)."""

    features: Features = "hidden"

    def divergence(self, src, dst):
        return torch.cdist(src.flatten(2), dst.flatten(2))


@EdgeScorer.register("random")
@dataclass
class RandomDivergence(EdgeScorer):
    """Random merge partners, blind to content: an ablation floor for the edge scorer.

    The divergence of A slot ``i`` and B slot ``j`` of a window is a fixed hash of ``(i, j)``
    and ``seed``, the same in every window, so a row gets the same partners alone or in a
    batch, and which token goes where says nothing about the features.

    Attributes:
        seed: changes the draw.
    """

    seed: int = 0

    def divergence(self, src, dst):
        k, a, b = src.shape[0], src.shape[1], dst.shape[1]
        slots = torch.arange(a, device=src.device)[:, None] * (b + 1) + torch.arange(b, device=src.device)[None, :]
        return seeded_uniform(slots, self.seed).to(src.dtype).expand(k, a, b)
