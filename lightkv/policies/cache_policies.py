"""Policies of the cache mode: attention accumulated over the prompt (`AccumulatedAttention`,
``accumulated_attention``), anchors by importance (`ImportancePartitioner`, ``importance``)
and H2O's keep rule (`h2o_keep`).

Pure tensors, no model: an adapter computes the queries and keys from a layer's own
projections and calls these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .partitioners import GlobalPartitioner, Partition, Partitioner
from .relevance import Relevance, _accumulator, _match_heads

__all__ = ["AccumulatedAttention", "ImportancePartitioner", "accumulated_attention", "h2o_keep"]


def accumulated_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    origin: torch.Tensor,
    scale: float | None = None,
    chunk: int = 256,
) -> torch.Tensor:
    """Causal attention each key receives, summed over heads and valid query rows: ``[B, N]``.

    ``softmax_j(scale * q_i . k_j)`` over the keys ``j`` with ``origin_j <= origin_i`` that
    are valid (what the causal model computes), summed over every valid query ``i`` and every
    query head. Query rows are processed ``chunk`` at a time, so memory is ``chunk x N`` per
    head, never ``N x N``.

    Args:
        queries: ``[B, H, N, d]`` post-RoPE queries.
        keys: ``[B, H_kv, N, d]`` post-RoPE keys.
        valid: ``[B, N]`` bool.
        origin: ``[B, N]`` original order (causality), ``-1`` for holes.
        scale: logit scale (default ``1 / sqrt(d)``).
    """
    b, h, n, d = queries.shape
    acc = _accumulator(queries)
    k = _match_heads(keys, h).to(acc)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.zeros(b, n, dtype=acc, device=queries.device)
    for start in range(0, n, chunk):
        q = queries[:, :, start : start + chunk].to(acc)
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, c, N]
        allowed = (origin.unsqueeze(1) <= origin[:, start : start + chunk].unsqueeze(2)) & valid.unsqueeze(1)
        allowed &= valid[:, start : start + chunk].unsqueeze(2)
        logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        attn = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # fully masked rows (padding) give 0
        out += attn.sum(dim=(1, 2))
    return out


@Relevance.register("accumulated_attention")
@dataclass
class AccumulatedAttention(Relevance):
    """Attention each vision token receives from every prompt token, summed over heads and
    queries (causal, as in the model): the importance of H2O (Zhang et al., NeurIPS 2023) and
    ElasticCache (Liu et al., ECCV 2024).

    Reads every query row and key column (``N x N`` per head, in chunks of ``chunk`` query
    rows; never the model's own attention weights, so any attention implementation works).
    Logits use ``1 / sqrt(d)``.
    """

    query_rows: ClassVar[str] = "all"
    key_cols: ClassVar[str] = "all"
    chunk: int = 256

    def score(self, queries, keys, layout):
        self._check(queries, keys, layout)
        xi = accumulated_attention(queries, keys, layout.valid_mask, layout.origin, chunk=self.chunk)
        return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))


@Partitioner.register("importance")
@dataclass
class ImportancePartitioner(Partitioner):
    """ElasticCache's anchors: in each window (an image, or a batch row's vision tokens), the
    ``floor(ratio * n_w)`` tokens with the lowest relevance are sources (they leave), the
    others are anchors (destinations). With a scorer and the ``divergence`` pruner, every
    source merges into its nearest anchor.

    Ties in relevance go to the later token leaving first (stable by position).

    Attributes:
        scope: ``image`` (one window per image) or ``row``.
    """

    scope: Literal["image", "row"] = "image"

    def partition(self, inputs):
        base = GlobalPartitioner(scope=self.scope, split="all_src").partition(inputs)
        window = base.window
        inside = window >= 0
        is_src = torch.zeros_like(inside)
        if not bool(inside.any()):
            return Partition(window, is_src)
        rel = inputs.relevance
        if rel is None:
            rel = torch.ones(window.shape, dtype=torch.float32, device=window.device)
        rel = rel.to(torch.float64)
        k = int(window.max()) + 1
        b, n = window.shape
        # order by (window, relevance, position): the first floor(ratio * n_w) of each window leave
        pos = torch.arange(n, device=window.device).expand(b, n)
        flat_w, flat_r, flat_p = window[inside], rel[inside], pos[inside]
        order = torch.argsort(flat_p.double(), descending=True, stable=True)  # later first on ties
        order = order[torch.argsort(flat_r[order], stable=True)]
        order = order[torch.argsort(flat_w[order], stable=True)]
        size = torch.bincount(flat_w, minlength=k)
        start = torch.cumsum(size, 0) - size
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device) - start[flat_w[order]]
        leave = torch.floor(size.double() * float(inputs.spec.removal_ratio) + 1e-9).long()
        leave = torch.minimum(leave, size - 1).clamp_min(0)  # at least one anchor
        is_src[inside] = rank < leave[flat_w]
        return Partition(window, is_src)


def h2o_keep(
    scores: torch.Tensor,
    candidate: torch.Tensor,
    origin: torch.Tensor,
    heavy: torch.Tensor,
    recent: torch.Tensor,
) -> torch.Tensor:
    """H2O's keep rule for one layer: ``[B, L]`` bool, True for entries that stay.

    Non-candidates always stay. Of the candidates, the ``recent[b]`` with the largest origin
    stay, and of the others the ``heavy[b]`` with the largest accumulated ``scores`` (ties to
    the earlier entry).

    Args:
        scores: ``[B, L]`` accumulated attention per entry.
        candidate: ``[B, L]`` bool, entries that may be evicted.
        origin: ``[B, L]`` original column of each entry.
        heavy: ``[B]`` heavy hitters to keep per row.
        recent: ``[B]`` most recent entries to keep per row.
    """
    b, length = scores.shape
    cols = torch.arange(length, device=scores.device).expand(b, length)

    def rank(key: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        key = key.masked_fill(~mask, math.inf)
        order = torch.sort(key, dim=1, stable=True).indices
        out = torch.empty_like(order)
        out.scatter_(1, order, cols)
        return out

    by_recency = rank(-origin.double(), candidate)
    is_recent = candidate & (by_recency < recent.unsqueeze(1))
    rest = candidate & ~is_recent
    by_score = rank(-scores.double(), rest)
    is_heavy = rest & (by_score < heavy.unsqueeze(1))
    return ~candidate | is_recent | is_heavy
