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

__all__ = [
    "DEFAULT_DIVERGENCE_BYTES",
    "CosineDivergence",
    "EdgeScorer",
    "L2Divergence",
    "RandomDivergence",
]


DEFAULT_DIVERGENCE_BYTES = 256 * 2**20
"""The default memory budget of a non-bilinear divergence's pairwise intermediates (256 MiB;
a pipeline's ``divergence_memory_mib`` sets another)."""


def _chunks(total: int, step: int) -> list[tuple[int, int]]:
    return [(i, min(i + step, total)) for i in range(0, total, step)]


class EdgeScorer(Policy):
    """Family: how dissimilar two tokens are (lower = better merge partners).

    Override `divergence`; `best_edges` batches it over all windows at once. A divergence
    that is not `bilinear` (it builds ``[K, a, b, *F]`` pairwise intermediates, e.g. a JS
    divergence between per-head distributions) is evaluated in chunks of windows, and of
    source rows inside a window, so that its intermediates stay within the stage's memory
    budget (`StageInputs.divergence_budget`); the result is the same as in one call. A
    scorer that needs more than two feature blocks (relevance, sizes, the layout) overrides
    `match`.

    Attributes:
        features: which per-token features to compare: ``"hidden"`` (the residual stream
            ``[D]`` per token, as LightKV) or ``"key_states"`` (the layer's attention keys,
            ``[H_kv, d]`` per token, computed by the adapter when a scorer asks for them).
    """

    family: ClassVar[str] = "scorer"
    features: Features = "hidden"

    bilinear: ClassVar[bool] = False
    """True when `divergence` holds no per-pair feature tensor (a matrix product or a
    distance routine, as cosine and L2): it runs in one call over all windows. False (the
    default, the safe assumption for a new scorer): it runs in memory-bounded chunks."""
    pair_intermediates: ClassVar[int] = 4
    """How many ``[pairs, *F]`` tensors a non-bilinear `divergence` holds at once (sizes
    its chunks: pairs per chunk = budget / (this x F x bytes per element))."""

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

    def match(
        self, inputs: StageInputs, graph: BipartiteGraph
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each A node's best partner for a stage: `best_edges` on
        ``inputs.features(self.features)``.

        Returns:
            ``(dst [K, a_max], divergence [K, a_max])`` as `best_edges`.
        """
        feats = inputs.features(self.features)

        def best(part: BipartiteGraph):
            return self.best_block_edges(
                part,
                part.token_blocks(feats, "src"),
                part.token_blocks(feats, "dst"),
                inputs.divergence_budget,
            )

        groups = graph.window_groups()
        if len(groups) == 1:
            return best(graph)
        # Windows of very different sizes, one product per group of similar ones: each
        # entry depends on its own two tokens only, so the pieces are the one-call entries.
        k, a = graph.src_slots.shape
        best_dst = graph.src_slots.new_full((k, a), -1)
        best_div = None
        for windows in groups:
            dst, div = best(graph.select_windows(windows))
            if best_div is None:
                best_div = div.new_full((k, a), float("inf"))
            best_dst[windows, : dst.shape[1]] = dst
            best_div[windows, : div.shape[1]] = div
        assert best_div is not None  # several groups, so the loop ran
        return best_dst, best_div

    def match_survivors(
        self,
        inputs: StageInputs,
        window: torch.Tensor,
        graph: BipartiteGraph,
        removed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Partners for a pruner that names none (a keep set): ``(src [R], dst [R])`` node
        indices, every removed A slot of ``graph`` (``removed [K, a_max]`` bool) and its least
        divergent survivor in the same window (``-1`` where the window keeps nothing).

        The match runs on a second graph over the same windows (``window [B, N]``, the
        partition's) whose side A is the removed tokens and side B all the window keeps (its
        kept A tokens and its B tokens); built from the same windows, its nodes are
        ``graph``'s, in one order.
        """
        src_nodes = graph.src_slots[removed]
        is_src = torch.zeros(window.shape, dtype=torch.bool, device=window.device)
        is_src[graph.node_row[src_nodes], graph.node_pos[src_nodes]] = True
        regraph = BipartiteGraph.build(window, is_src)
        best_dst, _ = self.match(inputs, regraph)
        valid = regraph.src_slots >= 0
        return regraph.src_slots[valid], best_dst[valid]

    def best_edges(
        self, graph: BipartiteGraph, node_features: torch.Tensor, budget: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each A node's least divergent B node in its window.

        Args:
            graph: the batched graph.
            node_features: ``[M, *F]`` per-node features.
            budget: bytes a non-`bilinear` divergence's intermediates may take at once
                (None: `DEFAULT_DIVERGENCE_BYTES`); bilinear scorers ignore it.

        Returns:
            ``(dst [K, a_max], divergence [K, a_max])``: node index of the best partner
            (``-1`` where the slot is padding or the window has no B node) and its
            divergence (``+inf`` there). Ties go to the earliest B token.
        """
        return self.best_block_edges(
            graph, graph.blocks(node_features, "src"), graph.blocks(node_features, "dst"), budget
        )

    def best_block_edges(
        self, graph: BipartiteGraph, src: torch.Tensor, dst: torch.Tensor, budget: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`best_edges` from the windows' feature blocks (``graph.blocks`` or
        ``graph.token_blocks``): ``src [K, a_max, *F]``, ``dst [K, b_max, *F]``, zero padding."""
        acc = torch.promote_types(src.dtype, torch.float32)
        src, dst = src.to(acc), dst.to(acc)
        k, a = graph.src_slots.shape
        if graph.dst_slots.shape[1] == 0 or a == 0:
            return graph.src_slots.new_full((k, a), -1), src.new_full((k, a), float("inf"))
        b = graph.dst_slots.shape[1]
        pairs = self.chunk_pairs(src[0, 0].numel(), src.element_size(), budget)
        best_div: torch.Tensor | None
        best_slot: torch.Tensor | None
        if self.bilinear or k * a * b <= pairs:
            best_div, best_slot = self._best(src, dst, graph.dst_slots)
        else:
            # Whole windows while they fit, else source rows of one window at a time: every
            # divergence entry depends on its own two tokens only, so the pieces are the
            # entries of the one-call result, and so are their minima.
            best_div = best_slot = None
            windows = max(1, pairs // (a * b))
            rows = a if windows > 1 else max(1, min(a, pairs // b))
            for k0, k1 in _chunks(k, windows):
                for r0, r1 in _chunks(a, rows):
                    div, slot = self._best(src[k0:k1, r0:r1], dst[k0:k1], graph.dst_slots[k0:k1])
                    # the divergence's own dtype, as in one call
                    if best_div is None or best_slot is None:
                        best_div, best_slot = div.new_empty((k, a)), slot.new_empty((k, a))
                    best_div[k0:k1, r0:r1], best_slot[k0:k1, r0:r1] = div, slot
        assert best_div is not None and best_slot is not None  # k, a > 0: the loops ran
        best_dst = graph.dst_slots.gather(1, best_slot)
        invalid = (graph.src_slots < 0) | torch.isinf(best_div)
        return best_dst.masked_fill(invalid, -1), best_div.masked_fill(invalid, float("inf"))

    def chunk_pairs(self, features: int, element_bytes: int, budget: int | None = None) -> int:
        """How many (A, B) pairs one call of a non-bilinear `divergence` may cover within
        ``budget`` bytes (None: `DEFAULT_DIVERGENCE_BYTES`), for ``features`` elements of
        ``element_bytes`` bytes per token; at least one source row's worth is always allowed."""
        budget = DEFAULT_DIVERGENCE_BYTES if budget is None else budget
        return max(1, budget // max(1, self.pair_intermediates * features * element_bytes))

    def _best(
        self, src: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(min divergence, its B slot)`` per A row of ``[k, a, *F]`` x ``[k, b, *F]``."""
        div = self.divergence(src, dst)
        expected = (src.shape[0], src.shape[1], dst.shape[1])
        if div.shape != expected:
            raise ValueError(
                f"{type(self).__name__}.divergence returned {tuple(div.shape)}, expected {expected}"
            )
        return div.masked_fill((dst_slots < 0).unsqueeze(1), float("inf")).min(dim=-1)


@EdgeScorer.register("cosine")
@dataclass
class CosineDivergence(EdgeScorer):
    """Feature divergence ``FD(a, b) = 1 - cos(x_a, x_b)``.

    LightKV's edge weight (Chen, Guo, Zimmermann, TMLR 2026, arXiv:2605.00789); ToMe
    (Bolya et al., ICLR 2023) matches on the same cosine similarity.

    Attributes:
        features: ``"hidden"`` or ``"key_states"``.
        eps: guards the norm of all-zero features.
    """

    features: Features = "hidden"
    eps: float = 1e-12

    bilinear: ClassVar[bool] = True

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

    bilinear: ClassVar[bool] = True

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

    bilinear: ClassVar[bool] = True

    def divergence(self, src, dst):
        k, a, b = src.shape[0], src.shape[1], dst.shape[1]
        slots = (
            torch.arange(a, device=src.device)[:, None] * (b + 1)
            + torch.arange(b, device=src.device)[None, :]
        )
        return seeded_uniform(slots, self.seed).to(src.dtype).expand(k, a, b)
