"""Policies of the cache mode: attention accumulated over the prompt (`AccumulatedAttention`,
``accumulated_attention``), anchors by importance (`ImportancePartitioner`, ``importance``)
and H2O's keep rule (`h2o_keep`).

Pure tensors, no model: an adapter computes the queries and keys from a layer's own
projections and calls these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..policies.partitioners import GlobalPartitioner, Partition, Partitioner
from ..policies.relevance import Relevance, _accumulator, _match_heads

__all__ = [
    "AccumulatedAttention",
    "ImportancePartitioner",
    "accumulated_attention",
    "accumulated_attention_flops",
    "causal_chunks",
    "h2o_keep",
]


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
    head, never ``N x N``; each chunk reads only the key columns up to the last one any of
    its queries may attend to and masks only the columns some of them may not
    (`causal_chunks`): about half of ``N x N`` logits, the same sums as the full masked
    softmax up to float rounding (the column sums are accumulated in float64).

    Args:
        queries: ``[B, H, N, d]`` post-RoPE queries.
        keys: ``[B, H_kv, N, d]`` post-RoPE keys.
        valid: ``[B, N]`` bool.
        origin: ``[B, N]`` original order (causality), ``-1`` for holes.
        scale: logit scale (default ``1 / sqrt(d)``).
        chunk: query rows per step.
    """
    b, h, n, d = queries.shape
    acc = _accumulator(queries)
    k_t = _match_heads(keys, h).to(acc).transpose(-1, -2)  # [B, H, d, N]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # float64 sums: a column adds one block sum per head and chunk (384 at 7B width), which
    # added in float32 drifted by 1e-5 relative (measured; near-ties decide what is kept)
    out = torch.zeros(
        b, n, dtype=acc if queries.device.type == "mps" else torch.float64, device=queries.device
    )
    # j is allowed for i iff key_at[j] <= query_at[i]: causal, and both valid (holes never match)
    big = torch.iinfo(origin.dtype).max
    key_at = origin.masked_fill(~valid, big)
    query_at = origin.masked_fill(~valid, -1)
    plan = causal_chunks(valid, origin, chunk)
    key_at = torch.cat(
        [key_at, key_at.new_full((b, _padded(n) - n), big)], 1
    )  # the rows' padding: seen by none
    # One buffer, reused: a fresh allocation of tens of MB is fresh pages faulted in on first
    # touch. Blocks of heads x rows x columns of at most _BLOCK floats per thread where one
    # head allows (a few heads of a chunk at 7B width, a whole chunk of a small model): each
    # block is written by its matmul and read back by the softmax and the column sum while
    # it is still in cache, where one chunk of every head (~100 MB at 7B width) made each
    # pass a trip to memory (1 thread: 0.67 s -> 0.45 s at 7B width, 32 heads, 2,970 tokens).
    # Per thread: with 2 threads on 2 shared cores, every parallel operator waits for a
    # descheduled thread (measured: 1-MB-per-thread blocks 5x slower than 16 MB there).
    widest = min(chunk, n) * _padded(max((end for end, _, _ in plan), default=0))
    block = (
        _BLOCK * torch.get_num_threads() if queries.is_cpu else h * widest
    )  # an accelerator: every head at once
    buf = torch.empty(max(widest, min(block, h * widest)), dtype=acc, device=queries.device)
    for start, (end, lo, holes) in zip(range(0, n, chunk), plan):
        if end == 0:  # no valid query in the chunk: it adds nothing
            continue
        stop = start + chunk
        q = queries[:, :, start:stop].to(acc) * scale  # scaled here, not the c x end logits
        c, width = q.shape[2], _padded(end)
        group = max(1, min(h, block // (c * width)))
        # Columns past `end` are masked for every query of the chunk and would add exact
        # zeros, columns before `lo` are allowed for every valid query: only [lo, end) needs
        # the mask, and [end, width) is the rows' padding (-inf, in the same operation).
        blocked = key_at[:, None, lo:width] > query_at[:, start:stop, None]  # [B, c, width - lo]
        for r in range(b):
            for h0 in range(0, h, group):
                g = min(group, h - h0)
                # rows `width` long, the columns past `end` -inf: every real column then takes
                # the vectorised path of the softmax and of the column sum, so equal attention
                # sums to equal scores (a column in a kernel's scalar tail is summed in another
                # order, and an exact tie would be broken by rounding instead of by position)
                logits = buf[: g * c * width].view(g, c, width)
                torch.matmul(q[r, h0 : h0 + g], k_t[r, h0 : h0 + g, :, :end], out=logits[..., :end])
                logits[..., lo:].masked_fill_(blocked[r], float("-inf"))
                # in place on the CPU, whose kernel normalises a row after reading it (one buffer
                # in cache instead of two); elsewhere a fresh tensor, aliasing unchecked there
                attn = (
                    torch.ops.aten._softmax.out(logits, -1, False, out=logits)
                    if logits.is_cpu
                    else torch.softmax(logits, -1)
                )
                if (
                    holes
                ):  # padding queries attend to nothing: 0 (what a fully masked row's NaN became)
                    attn.masked_fill_(~valid[r, None, start:stop, None], 0.0)
                out[r, :end] += attn.sum(dim=(0, 1))[:end]
    return out.to(acc)


def accumulated_attention_flops(
    valid: torch.Tensor, origin: torch.Tensor, heads: int, head_dim: int, chunk: int = 256
) -> float:
    """Multiply-add FLOPs (2 per MAC) of the ``q . k`` products `accumulated_attention`
    computes: each chunk's rows times the key columns it reads (`causal_chunks`: the causal
    half of ``N x N`` plus the chunks' diagonal blocks), every head and batch row. Counted as
    the model's own attention is (`lightkv.adapters.probes.LayerShape.flops`): the softmax
    and the sums, a few operations per logit, are not. One host sync.

    Args:
        valid: ``[B, N]`` bool.
        origin: ``[B, N]`` original order, ``-1`` for holes.
        heads: query heads.
        head_dim: their size.
        chunk: query rows per step (as given to `accumulated_attention`).
    """
    b, n = valid.shape
    rows = (min(chunk, n - start) for start in range(0, n, chunk))
    logits = sum(r * end for r, (end, _, _) in zip(rows, causal_chunks(valid, origin, chunk)))
    return 2.0 * b * heads * head_dim * logits


def _padded(columns: int) -> int:
    """``columns`` rounded up to a multiple of 64 (a whole number of unrolled vectors)."""
    return -(-columns // 64) * 64


_BLOCK = 1 << 22
"""Floats per block of logits and thread in `accumulated_attention` (16 MB in float32;
measured at 7B width, 1 thread: 4 and 16 MB alike, 32 MB and more slower)."""

_MIN_COLUMNS = 64
"""Shortest softmax row `accumulated_attention` computes (longer than any CPU vector)."""
_MIN_ROWS = 8
"""Fewest query rows for which `accumulated_attention` leaves out key columns."""


def causal_chunks(
    valid: torch.Tensor, origin: torch.Tensor, chunk: int
) -> list[tuple[int, int, bool]]:
    """For each chunk of ``chunk`` query rows, what `accumulated_attention` must mask, over
    all batch rows, as ``(end, lo, holes)``: ``end`` is one past the last key column a valid
    query of the chunk may attend to (``origin_j <= origin_i``, both valid; 0 for a chunk
    without valid queries), every column before ``lo`` is allowed for every valid query of
    the chunk, and ``holes`` says whether the chunk has invalid query rows. One host sync.

    Args:
        valid: ``[B, N]`` bool.
        origin: ``[B, N]`` original order, ``-1`` for holes.
        chunk: query rows per chunk.
    """
    b, n = valid.shape
    if n == 0:
        return []
    chunks = -(-n // chunk)
    big = torch.iinfo(origin.dtype).max

    def by_chunk(t: torch.Tensor, fill) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, chunks * chunk - n), value=fill).view(
            b, chunks, chunk
        )

    keys = origin.masked_fill(~valid, big)  # a hole is seen by no query
    latest = by_chunk(origin.masked_fill(~valid, -1), -1).amax(dim=-1)  # [B, C]
    earliest = by_chunk(keys, big).amin(dim=-1)  # [B, C], big: no valid query
    col = torch.arange(n, device=valid.device)
    seen = keys.unsqueeze(1) <= latest.unsqueeze(2)  # [B, C, N] allowed for some valid query
    end = torch.where(seen, col + 1, 0).amax(dim=(0, 2))
    # Bit-identity with the full row: a softmax row shorter than a SIMD vector takes the
    # kernel's scalar path (other exp, other sum order), so rows stay at least _MIN_COLUMNS
    # long; a chunk of one query row is a matrix-vector product, whose summation order
    # depends on the row's length, so chunks of fewer than _MIN_ROWS rows read every
    # column. The extra columns are masked like the others.
    rows = (n - torch.arange(chunks, device=valid.device) * chunk).clamp_max(chunk)
    end = torch.where(rows < _MIN_ROWS, n, end.clamp_min(min(n, _MIN_COLUMNS)))
    end = torch.where(seen.any(dim=2).any(dim=0), end, 0)
    blocked = (keys.unsqueeze(1) > earliest.unsqueeze(2)) & (earliest < big).unsqueeze(2)
    lo = torch.minimum(torch.where(blocked, col, n).amin(dim=(0, 2)), end)
    holes = (~by_chunk(valid, True)).any(dim=-1).any(dim=0)
    bounds = torch.stack([end, lo, holes.long()]).T.tolist()
    return [(e, lo_, bool(h)) for e, lo_, h in bounds]


@Relevance.register("accumulated_attention")
@dataclass
class AccumulatedAttention(Relevance):
    """Attention each vision token receives from every prompt token, summed over heads and
    queries (causal, as in the model): the importance of H2O (Zhang et al., NeurIPS 2023) and
    ElasticCache (Liu et al., ECCV 2024).

    Reads every query row and key column, computes the causal half of ``N x N`` per head
    (in chunks of ``chunk`` query rows, `accumulated_attention_flops`; never the model's own
    attention weights, so any attention implementation works).
    Logits use ``1 / sqrt(d)``.
    """

    query_rows = "all"
    key_cols = "all"
    chunk: int = 256

    def product_flops(self, layout, heads, head_dim):
        return accumulated_attention_flops(
            layout.valid_mask, layout.origin, heads, head_dim, self.chunk
        )

    def score(self, queries, keys, layout):
        self._check(queries, keys, layout)
        xi = accumulated_attention(
            queries, keys, layout.valid_mask, layout.origin, chunk=self.chunk
        )
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
