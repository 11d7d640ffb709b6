"""Pruners: which tokens leave the sequence at a stage.

A pruner ranks the A tokens of every window by a removal key (lower leaves first) and
removes the ``r`` lowest per window. The budget is LightKV's
``r = min(floor(P * n_w), |A_w|)``, where ``n_w`` counts the window's A and B tokens; for
pruners that merge into a partner (``needs_partner``), a window without B tokens removes
nothing. The divergence pruners can instead cap at ``floor(n_w / 2)`` (``cap: half``), the
reference code's rule: with a parity split ``|A_w| = ceil(n_w / 2)``, so the two differ only
for odd windows at ``P > 0.5`` (288 tokens at P = 0.75: 145 left with ``sources``, 143 with
``half``). `RelevanceBudget` keeps each image's total but moves removals between its
windows by relevance (`allocate_removals` rounds the shares).

The subset pruners (`KeepSetPruner`: DivPrune, CDPruner, DART) choose the kept tokens of a
window jointly instead of ranking them by a key; they keep exactly ``k = n_w - r_w`` tokens
with ``r_w = exact_removals(graph, ratio)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..graph.bipartite import BipartiteGraph
from ..graph.scatter import scatter_min, scatter_sum
from .base import Policy
from .counts import removal_count
from .hashing import seeded_uniform
from .inputs import StageInputs

__all__ = [
    "Pruner",
    "PruneInputs",
    "SmallestDivergence",
    "RelevanceAwareDivergence",
    "LowestRelevance",
    "RandomPruner",
    "AllSources",
    "RelevanceBudget",
    "allocate_removals",
    "exact_removals",
    "KeepSetPruner",
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
                f"unknown cap {cap!r}; choose 'sources' (|A| per window) or 'half' (floor(n/2), reference code)"
            )
        if self.needs_partner:
            r = torch.where(graph.dst_count > 0, r, torch.zeros_like(r))
        return r

    def select(self, inputs: PruneInputs, ratio: float) -> torch.Tensor:
        """``[K, a_max]`` bool: the A slots to remove."""
        return self.remove_lowest(inputs, self.budget(inputs.graph, ratio))

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


@Pruner.register("divergence")
@dataclass
class SmallestDivergence(Pruner):
    """Remove the A tokens closest to their best partner.

    LightKV's candidate set (Chen, Guo, Zimmermann, TMLR 2026, arXiv:2605.00789) and
    ToMe's bipartite soft matching (Bolya et al., ICLR 2023, arXiv:2210.09461).

    Attributes:
        cap: the most a window loses: ``sources`` (all of side A) or ``half``
            (``floor(n_w / 2)``, the reference code's cap).
        budget_dtype: ``float64`` (``floor(P * n_w)`` on the exact product) or ``float32``
            (the released code's float32 product, truncated: one more token can leave
            where ``P * n_w`` is just below an integer; the ``lightkv-paper*`` presets).
    """

    cap: Literal["sources", "half"] = "sources"
    budget_dtype: Literal["float64", "float32"] = "float64"

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


@Pruner.register("all_sources")
@dataclass
class AllSources(Pruner):
    """Remove every A token of every window that has B tokens: the partitioner decides
    alone what leaves (VisionZip's ``dominant_context``, the ``resize`` downsampling), so
    the stage's ratio is spent there, not here (at ratio 0 nothing leaves).
    """

    def budget(self, graph, ratio):
        """``[K]``: ``|A_w|`` where the window has B tokens, else 0; 0 everywhere at ratio 0."""
        every = torch.where(graph.dst_count > 0, graph.src_count, torch.zeros_like(graph.src_count))
        return every if ratio > 0 else torch.zeros_like(every)

    def key(self, inputs):
        return inputs.divergence


def allocate_removals(
    ideal: torch.Tensor, capacity: torch.Tensor, group: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """Integer removals per window that add up to ``total`` in every group: the largest
    remainder method with caps, loop-free.

    Window ``k`` offers ``capacity[k]`` removal slots; its ``j``-th slot has priority
    ``ideal[k] - j``, and each group takes its ``total[g]`` slots of highest priority (ties:
    the lower window, then the lower slot). So a window gets ``floor(ideal)`` or
    ``ceil(ideal)`` when no cap binds, and what a full window cannot take goes to the
    windows whose ideal is least met.

    Args:
        ideal: ``[K]`` float, the real-valued removals wanted per window (any sign).
        capacity: ``[K]`` int64, the most each window can lose.
        group: ``[K]`` int64 group of each window, in ``[0, G)``.
        total: ``[G]`` int64 removals per group, at most the group's summed capacity.

    Returns:
        ``[K]`` int64 removals, ``0 <= out <= capacity``, summing to ``total`` per group.
    """
    k = capacity.shape[0]
    width = int(capacity.max()) if k else 0
    if width == 0:
        return torch.zeros_like(capacity)
    slot = torch.arange(width, device=capacity.device)
    valid = slot.unsqueeze(0) < capacity.unsqueeze(1)  # [K, width]
    priority = (ideal.to(torch.float64).unsqueeze(1) - slot).masked_fill(~valid, -math.inf)[valid]
    win = torch.arange(k, device=capacity.device).unsqueeze(1).expand(k, width)[valid]
    grp = group[win]
    order = torch.sort(
        -priority, stable=True
    ).indices  # highest first; ties keep (window, slot) order
    order = order[torch.sort(grp[order], stable=True).indices]
    per_group = scatter_sum(torch.ones_like(grp), grp, total.shape[0])
    start = torch.cumsum(per_group, 0) - per_group
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device) - start[grp[order]]
    taken = rank < total[grp]
    return scatter_sum(taken.long(), win, k)


@Pruner.register("relevance_budget")
@dataclass
class RelevanceBudget(Pruner):
    """Smallest divergence first, with removals moved from relevant windows to irrelevant
    ones: the same total per image as `SmallestDivergence`, a smaller removal ratio where
    the prompt looks.

    Each image (``scope="image"``) or batch row (``scope="row"``) removes exactly as many
    tokens as the plain budget ``min(floor(P · n_w), |A_w|)`` summed over its windows. That
    total is shared out in proportion to ``r_w · (d_w + 1e-6)^-strength``, where ``r_w`` is
    the window's plain budget and ``d_w`` its mean relevance ξ (over all its tokens, A and
    B) divided by the image's; `allocate_removals` rounds the shares to integers (largest
    remainder) with each window losing at most what it can (its A side, ``cap: half``
    ``floor(n_w / 2)``, nothing without B tokens). Inside a window the smallest
    divergences leave, as with `SmallestDivergence`.

    With ``strength=0`` or uniform ξ this is `SmallestDivergence`. With the parity split at
    ``P = 0.5`` every window already loses its whole A side, so there is nothing to move:
    combine with a split that offers more sources (``relevance_split`` with
    ``sources > 0.5``, ``random``, ``all_src``) or use ratios below 0.5. A window that
    spans several images (``global`` with ``scope: row``) counts with its first image.

    Attributes:
        strength: how strongly relevance moves the budget (0: not at all; 1: removal ratio
            inversely proportional to the window's relevance density).
        cap: as `SmallestDivergence`.
        scope: ``image`` (totals kept per image) or ``row`` (per batch row: budget may move
            between the images of a row).
    """

    strength: float = 1.0
    cap: Literal["sources", "half"] = "sources"
    scope: Literal["image", "row"] = "image"

    def __post_init__(self) -> None:
        if (
            isinstance(self.strength, bool)
            or not isinstance(self.strength, (int, float))
            or not (0.0 <= self.strength < math.inf)
        ):
            raise ValueError(f"strength must be a finite number >= 0, got {self.strength!r}")
        if self.scope not in ("image", "row"):
            raise ValueError(f"unknown scope {self.scope!r}; choose 'image' or 'row'")

    def key(self, inputs):
        return inputs.divergence

    def budget(self, graph, ratio):
        """``[K]`` the most a window may lose (its plain budget at ratio 1): ``|A_w|``, with
        ``cap == "half"`` at most ``floor(n_w / 2)``, 0 without B tokens. How many actually
        leave is `allocate`'s."""
        return super().budget(graph, 1.0)

    def allocate(self, inputs: PruneInputs, ratio: float) -> torch.Tensor:
        """``[K]`` int64 removals per window; per image (or row) their sum is the plain
        budget's.

        Raises:
            ValueError: ``inputs.stage`` is None (the stage always passes it).
        """
        graph, stage = inputs.graph, inputs.stage
        if stage is None:
            raise ValueError(
                "the relevance_budget pruner reads the stage's layout and relevance: pass PruneInputs.stage"
            )
        plain = Pruner.budget(self, graph, ratio)
        k = graph.num_windows
        if k == 0:
            return plain
        owner = (
            graph.node_row
            if self.scope == "row"
            else stage.layout.image[graph.node_row, graph.node_pos]
        )
        group = torch.unique(scatter_min(owner, graph.node_window, k)[0], return_inverse=True)[1]
        g = int(group.max()) + 1 if k else 0
        if stage.relevance is None:
            xi = torch.ones(graph.num_nodes, dtype=torch.float64, device=plain.device)
        else:
            xi = graph.gather(stage.relevance).to(torch.float64)
        n = graph.window_size.to(torch.float64)
        mass = scatter_sum(xi, graph.node_window, k)
        mean = scatter_sum(mass, group, g) / scatter_sum(n, group, g)
        density = torch.where(mean[group] > 0, mass / n / mean[group], torch.ones_like(mass))
        share = plain.to(torch.float64) * (density + 1e-6).pow(-float(self.strength))
        total = scatter_sum(plain, group, g)
        norm = scatter_sum(share, group, g)
        ideal = torch.where(
            norm[group] > 0, total[group] * share / norm[group], torch.zeros_like(share)
        )
        return allocate_removals(ideal, self.budget(graph, ratio), group, total)

    def select(self, inputs, ratio):
        return self.remove_lowest(inputs, self.allocate(inputs, ratio))


def exact_removals(graph: BipartiteGraph, ratio: float | torch.Tensor) -> torch.Tensor:
    """``[K]`` int64 removals per window for the subset pruners:
    ``r_w = min(floor(ratio * n_w + EPS), |A_w|)`` (`lightkv.policies.counts.removal_count`,
    which `lightkv.policies.counts.kept_count` uses for whole images).

    A budget stated as "keep ``k`` of ``n``" is ``ratio = 1 - k / n``; without the epsilon
    the float error of that expression can make the floor one short (it keeps ``k + 1``).
    """
    return torch.minimum(removal_count(graph.window_size, ratio).clamp_min(0), graph.src_count)


class KeepSetPruner(Pruner):
    """Base of the pruners that choose a window's *kept* set jointly (DivPrune, CDPruner,
    DART): override `keep`. No partners (``needs_partner = False``): with ``drop`` what they
    do not keep leaves; with a merging passer it merges into its most similar survivor
    (`lightkv.policies.EdgeScorer.match_survivors`). The budget is `exact_removals`: every
    window keeps exactly ``|A_w| - r_w`` of its A tokens (with ``split: all_src``: of all its
    tokens). Only A tokens compete; B tokens, if a split makes any, always stay.
    """

    needs_partner: ClassVar[bool] = False

    def keep(self, inputs: PruneInputs, count: torch.Tensor) -> torch.Tensor:
        """``[K, a_max]`` bool: in each window, exactly ``count[k]`` (``[K]`` int64) valid A
        slots that stay. Never true on padding slots (``graph.src_slots < 0``)."""
        raise NotImplementedError

    def budget(self, graph, ratio):
        """``[K]``: `exact_removals`."""
        return exact_removals(graph, ratio)

    def removals(self, inputs: PruneInputs, ratio: float) -> torch.Tensor:
        """``[K]`` int64 tokens each window loses: `budget` (a pruner whose count depends on
        more than the graph, e.g. exact per image over several windows, overrides this)."""
        return self.budget(inputs.graph, ratio)

    def select(self, inputs, ratio):
        """``[K, a_max]`` bool: the valid A slots that `keep` does not keep."""
        valid = inputs.graph.src_slots >= 0
        removals = self.removals(inputs, ratio)
        if not bool((removals > 0).any()):
            return torch.zeros_like(valid)
        kept = self.keep(inputs, valid.sum(1) - removals)
        return valid & ~kept

    @staticmethod
    def stage_of(inputs: PruneInputs, who: str) -> StageInputs:
        """``inputs.stage``, or a clear error for a pruner called without it."""
        if inputs.stage is None:
            raise ValueError(f"the {who} pruner reads the stage's features: pass PruneInputs.stage")
        return inputs.stage

    @staticmethod
    def unit_features(inputs: PruneInputs, stage: StageInputs, kind: str) -> torch.Tensor:
        """``[K, a_max, F]`` the A tokens' features (heads flattened), L2-normalised, in
        float32 at least (bf16 cosines are too coarse to rank near-duplicates); zero on
        padding slots."""
        return KeepSetPruner.unit_rows(inputs.graph.token_blocks(stage.features(kind), "src"))

    @staticmethod
    def unit_rows(t: torch.Tensor) -> torch.Tensor:
        """``[K, P, *F]`` -> ``[K, P, F]``: each row flattened, in float32 at least,
        L2-normalised (zero rows stay zero)."""
        t = t.flatten(2).to(torch.promote_types(t.dtype, torch.float32))
        return t / t.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(t.dtype).tiny)
