"""`RelevanceBudget`: the same removals per image as `SmallestDivergence`, moved from
relevant windows to irrelevant ones; `allocate_removals` rounds the shares to integers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ...graph.scatter import scatter_min, scatter_sum
from .base import PruneInputs, Pruner

__all__ = ["RelevanceBudget", "allocate_removals"]


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
                "the relevance_budget pruner reads the stage's layout and relevance: "
                "pass PruneInputs.stage"
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
