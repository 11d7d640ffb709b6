"""Message passers: how removed tokens update the tokens they merge into.

The three stages mirror PyTorch Geometric's ``MessagePassing``:

* `MessagePasser.message`: what each removed source sends (its weighted features);
* `MessagePasser.aggregate`: sum the messages per destination (a scatter op, run on
  the selected scatter backend);
* `MessagePasser.update`: combine with the destination's own weighted features and
  normalise.

Subclasses usually only override `MessagePasser.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..graph.scatter import scatter_sum
from .base import Policy

__all__ = [
    "MessagePasser",
    "RelevanceWeightedMean",
    "SizeWeightedMean",
    "RelevanceSizeWeightedMean",
    "DropMessages",
]


class MessagePasser(Policy):
    """Family: merge removed A tokens into their destinations with a weighted mean.

    Destination ``b`` receiving the set ``R(b)`` becomes
    ``(w_b x_b + sum_{a in R(b)} w_a x_a) / (w_b + sum_{a in R(b)} w_a)``
    with ``w`` from `weight`. Where all weights of a group are 0, the plain mean is used.
    """

    family: ClassVar[str] = "passer"
    merges: ClassVar[bool] = True
    """False for passers that just drop removed tokens."""

    def weight(self, relevance: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
        """Message weight per node.

        Args:
            relevance: ``[M]`` prompt relevance ξ (non-negative).
            size: ``[M]`` number of original tokens each node already represents.

        Returns:
            ``[M]`` non-negative weights.
        """
        raise NotImplementedError

    def reweigh(self, provenance, relevance, src, dst):
        """The provenance with its tokens' size weights after merging ``src`` into ``dst``
        (``[R]`` rows of ``relevance [B * N]``); unchanged here (sizes count tokens)."""
        return provenance

    def message(self, x_src: torch.Tensor, w_src: torch.Tensor) -> torch.Tensor:
        """``[R, D]`` messages of the ``R`` removed sources (``x_src`` is the passer's own
        copy of their rows: it may be overwritten)."""
        return x_src.mul_(w_src.unsqueeze(-1))

    def aggregate(
        self, messages: torch.Tensor, w_src: torch.Tensor, dst: torch.Tensor, num_nodes: int
    ):
        """Sum messages and weights per destination: ``([num_nodes, D], [num_nodes])``
        (``dst`` indexes the receivers, ``num_nodes`` is their count)."""
        return scatter_sum(messages, dst, num_nodes), scatter_sum(w_src, dst, num_nodes)

    def update(
        self, x: torch.Tensor, w: torch.Tensor, agg: torch.Tensor, agg_w: torch.Tensor
    ) -> torch.Tensor:
        """``[Q, D]`` new features of the ``Q`` receivers from their own rows ``x`` (the
        passer's copy: it may be overwritten), weights ``w [Q]`` and aggregated messages."""
        den = w + agg_w
        # in place, in the order of (x * w + agg) / den: the same bits, no three [Q, D] temporaries
        return x.mul_(w.unsqueeze(-1)).add_(agg).div_(den.unsqueeze(-1))

    def __call__(
        self,
        x: torch.Tensor,
        relevance: torch.Tensor,
        size: torch.Tensor,
        src: torch.Tensor,
        dst: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge ``src`` nodes into ``dst`` nodes.

        Args:
            x: ``[M, D]`` features (a `lightkv.Stage` passes every token of the batch,
                ``[B * N, D]``, in the model's dtype; the rows merged are promoted to at
                least float32 here).
            relevance: ``[M]`` prompt relevance ξ per row.
            size: ``[M]`` original tokens each row represents.
            src: ``[R]`` removed rows.
            dst: ``[R]`` their destination rows.

        Returns:
            ``(receivers [Q], features [Q, D])``: the destination rows that changed (sorted)
            and their new features (at least float32).
        """
        acc = torch.promote_types(x.dtype, torch.float32)
        receivers = torch.unique(dst)
        if not self.merges or src.numel() == 0:
            return receivers[:0], x[:0].to(acc)
        w = self.weight(relevance, size).to(acc)
        # only the merged rows' weights matter (a Stage's rows outside the graph weigh 0)
        w_src, w_dst = w[src], w[receivers]
        if (
            (w_src < 0).any()
            or (w_dst < 0).any()
            or not (torch.isfinite(w_src).all() and torch.isfinite(w_dst).all())
        ):
            raise ValueError(f"{type(self).__name__}.weight must be finite and non-negative")
        # Groups whose weights are all zero fall back to a plain mean.
        agg_w0 = scatter_sum(w[src], dst, x.shape[0])
        zero_group = (w + agg_w0) <= 0
        in_zero_group = zero_group.clone()
        in_zero_group[src] = zero_group[dst]
        w = torch.where(in_zero_group, torch.ones_like(w), w)
        # Aggregate straight into the Q receivers (receivers is sorted), not into all M nodes.
        slot = torch.searchsorted(receivers, dst)
        agg, agg_w = self.aggregate(
            self.message(self._rows(x, src, acc), w[src]), w[src], slot, receivers.shape[0]
        )
        new = self.update(self._rows(x, receivers, acc), w[receivers], agg, agg_w)
        return receivers, new

    @staticmethod
    def _rows(x: torch.Tensor, index: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        """A fresh ``[len(index), D]`` copy of rows of ``x`` in ``acc``."""
        rows = x.index_select(0, index)
        return rows if rows.dtype == acc else rows.to(acc)


@MessagePasser.register("relevance_mean")
@dataclass
class RelevanceWeightedMean(MessagePasser):
    """ξ-weighted mean: tokens the prompt cares about dominate the merge.

    LightKV's message passing (Chen, Guo, Zimmermann, "Make Your LVLM KV Cache More
    Lightweight", TMLR 2026, arXiv:2605.00789).
    """

    def weight(self, relevance, size):
        return relevance


@MessagePasser.register("size_mean")
@dataclass
class SizeWeightedMean(MessagePasser):
    """Size-weighted mean: a token that already absorbed ``s`` originals counts ``s``
    times, so the result is the plain mean of all originals.

    ToMe's proportional merging (Bolya et al., "Token Merging: Your ViT But Faster",
    ICLR 2023, arXiv:2210.09461).
    """

    def weight(self, relevance, size):
        return size.to(torch.float64)


@MessagePasser.register("relevance_size_mean")
@dataclass
class RelevanceSizeWeightedMean(MessagePasser):
    """Relevance- and size-weighted mean: weight ``ξ^relevance_power · size^size_power``.

    With the default powers (1, 1) a token that already holds ``s`` originals counts ``s``
    times its relevance, so a merge is the ξ-weighted mean *over the originals*, each
    original weighted by the relevance of the token that represents it now: a large,
    relevant group is not diluted by a small one, as it is with ``relevance_mean``. The
    weights are normalised over each destination and the sources merged into it, so the
    result is a convex combination of the merged tokens (and of the originals).

    ``relevance_power = 0`` is ToMe's size-weighted mean (``size_mean``, also where ξ = 0);
    ``size_power = 0`` is LightKV's ``relevance_mean``. At the first stage every size is 1
    and the passer equals ``relevance_mean``.

    Attributes:
        relevance_power: exponent of ξ (``>= 0``).
        size_power: exponent of the size (``>= 0``).
    """

    relevance_power: float = 1.0
    size_power: float = 1.0

    def __post_init__(self) -> None:
        for name in ("relevance_power", "size_power"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not 0.0 <= value < float("inf")
            ):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def weight(self, relevance, size):
        """``ξ [M]``, ``size [M]`` -> ``[M]`` weights ``ξ^a · size^b`` (in ξ's dtype)."""
        s = size.to(relevance.dtype)
        xi = relevance if self.relevance_power == 1 else relevance.pow(self.relevance_power)
        return xi * (s if self.size_power == 1 else s.pow(self.size_power))


@MessagePasser.register("drop")
@dataclass
class DropMessages(MessagePasser):
    """No merging: removed tokens simply disappear (pure pruning, as FastV, PyramidDrop
    and random dropping)."""

    merges: ClassVar[bool] = False

    def weight(self, relevance, size):
        return torch.zeros_like(relevance)
