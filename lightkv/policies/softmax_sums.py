"""Sums of softmax-normalised ``q . k`` scores in blocks of bounded size.

A relevance that reads every query row and every text column (``query_softmax``,
``text_attention``) needs sums of softmax entries, never the entries themselves: each key
column normalised over the query rows (`column_softmax_sums`), or each query row over the
key columns (`row_softmax_sums`). Both normalisations are per line (a column, or a row), so
the lines can be taken a block at a time: a block holds whole lines of a few heads, at most
`block_elements` scores, and is summed into a ``[B, H, N]`` result before the next is
computed. The working set is then one block (``H x N x T`` floats before: 12 GB per stage at
7B width and 9,600 prompt tokens), every score is computed once, and each line's softmax is
the one the unblocked computation takes (the sums differ from it by rounding only).

On the CPU, `query_axis_sums` (``query_softmax``) takes two passes of PyTorch's fused CPU
attention kernel instead, which tiles the scores itself and returns each query row's
log-sum-exp: first with the text columns as its queries and every valid token as its keys
(``lse_t``, each column's normaliser over all queries), then with the vision rows as queries
and the text columns as keys, each score shifted by ``-lse_t`` (an extra dimension: 1 on the
rows, ``-lse_t / scale`` on the columns), whose log-sum-exp is ``log sum_t exp(s_it - lse_t)``:
the sum itself, in log space. Every score is computed in the kernel's tiles (four times faster
than a block's matrix product, softmax and sums, measured at 5,600 tokens); the values are
those of the blocked path to rounding.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

__all__ = [
    "BLOCK",
    "block_elements",
    "column_softmax_sums",
    "qk_scores",
    "query_axis_sums",
    "row_softmax_sums",
]

BLOCK = 1 << 22
"""Scores per block and CPU thread (16 MB in float32): a block is written by its matrix
product and read back by the softmax and the sums while it is still in cache (the same size
as `lightkv.methods.cache_policies.accumulated_attention`'s blocks)."""

_ACCELERATOR_BLOCK = 1 << 26
"""Scores per block on an accelerator (256 MB in float32): few enough launches per stage,
a bounded share of the device's memory."""

Scores = Callable[[int, slice, slice, torch.Tensor], torch.Tensor]
"""``scores(r, heads, lines, out)``: the scores of batch row ``r``, heads ``heads`` and lines
``lines`` (columns for `column_softmax_sums`, rows for `row_softmax_sums`) as ``[g, c, N]``
(``g`` heads, ``c`` lines, ``N`` along each line), written into ``out`` (that shape) or
returned as a new tensor of it."""


def block_elements(device: torch.device) -> int:
    """Scores per block on ``device``: `BLOCK` per CPU thread, or an accelerator's block."""
    if device.type == "cpu":
        return BLOCK * max(1, torch.get_num_threads())
    return _ACCELERATOR_BLOCK


def _sums(
    scores: Scores,
    heads: int,
    length: int,
    lines: list[int],
    dtype: torch.dtype,
    device: torch.device,
    prepare: Callable[[int, slice, torch.Tensor], None],
    block: int | None,
    empty_lines: bool = False,
) -> torch.Tensor:
    """``[B, H, N]`` float64 (the accelerator's float type on mps): for each batch row ``r``,
    the first ``lines[r]`` lines' softmax entries (over the ``length`` axis, after
    ``prepare(r, lines, logits)`` masked the block in place) summed over those lines; with
    ``empty_lines`` a line masked entirely adds 0 (its softmax is NaN)."""
    b = len(lines)
    total = torch.zeros(
        b, heads, length, dtype=dtype if device.type == "mps" else torch.float64, device=device
    )
    block = block or block_elements(device)
    cols = max(1, min(max(lines, default=1), block // max(length, 1)))  # lines per block
    group = max(1, min(heads, block // max(cols * length, 1)))  # heads per block
    # one buffer, reused: a fresh block of tens of MB is fresh pages faulted in at each step
    buf = torch.empty(group * cols * length, dtype=dtype, device=device)
    for r, count in enumerate(lines):
        for h0 in range(0, heads, group):
            hs = slice(h0, min(heads, h0 + group))
            g = hs.stop - h0
            for c0 in range(0, count, cols):
                ls = slice(c0, min(count, c0 + cols))
                out = buf[: g * (ls.stop - c0) * length].view(g, ls.stop - c0, length)
                logits = scores(r, hs, ls, out)
                prepare(r, ls, logits)
                # in place on the CPU, whose kernel normalises a line after reading it
                attn = (
                    torch.ops.aten._softmax.out(logits, -1, False, out=logits)
                    if logits.is_cpu
                    else torch.softmax(logits, -1)
                )
                if empty_lines:
                    attn = attn.nan_to_num_(0.0)
                total[r, hs] += attn.sum(dim=1)
    return total


def column_softmax_sums(
    scores: Scores,
    heads: int,
    valid: torch.Tensor,
    columns: torch.Tensor,
    dtype: torch.dtype,
    block: int | None = None,
) -> torch.Tensor:
    """Per head and query row, the sum over key columns of the scores normalised over the
    valid query rows (softmax over the query axis of each column).

    Args:
        scores: the ``[g, c, N]`` scores of ``c`` columns over the ``N`` query rows (`Scores`).
        heads: ``H``.
        valid: ``[B, N]`` bool, the query rows each column is normalised over (others get 0).
        columns: ``[B]`` how many columns of each batch row are read (its first ones).
        dtype: the scores' dtype.
        block: scores per block (default `block_elements`).

    Returns:
        ``[B, H, N]`` float64 (mps: ``dtype``).
    """
    every = valid.all(dim=1).tolist()
    hidden = ~valid

    def prepare(r: int, lines: slice, logits: torch.Tensor) -> None:
        if not every[r]:
            logits.masked_fill_(hidden[r], float("-inf"))

    lines = [int(c) for c in columns.tolist()]
    return _sums(scores, heads, valid.shape[1], lines, dtype, valid.device, prepare, block)


def row_softmax_sums(
    scores: Scores,
    heads: int,
    allowed: Callable[[int, slice], torch.Tensor],
    rows: torch.Tensor,
    length: int,
    dtype: torch.dtype,
    block: int | None = None,
) -> torch.Tensor:
    """Per head and key column, the sum over query rows of each row's softmax over the key
    columns it may see (a row that may see none adds 0).

    Args:
        scores: the ``[g, c, N]`` scores of ``c`` query rows over the ``N`` key columns.
        heads: ``H``.
        allowed: ``allowed(r, lines)``: ``[c, N]`` bool, which columns each of batch row
            ``r``'s rows ``lines`` may see.
        rows: ``[B]`` how many rows of each batch row are read (its first ones).
        length: ``N``.
        dtype: the scores' dtype.
        block: scores per block (default `block_elements`).

    Returns:
        ``[B, H, N]`` float64 (mps: ``dtype``).
    """

    def prepare(r: int, lines: slice, logits: torch.Tensor) -> None:
        logits.masked_fill_(~allowed(r, lines), float("-inf"))

    lines = [int(c) for c in rows.tolist()]
    return _sums(scores, heads, length, lines, dtype, rows.device, prepare, block, True)


def qk_scores(
    lines: torch.Tensor,
    along: torch.Tensor,
    heads: int,
    divisor: float,
    dtype: torch.dtype,
    index: torch.Tensor | None = None,
) -> Scores:
    """`Scores` of products ``lines . along / divisor`` in ``dtype``.

    Args:
        lines: ``[B, H_l, L, d]``: one vector per line (``H_l`` divides ``H``: head ``h``
            reads ``lines``' head ``h // (H / H_l)``, grouped-query attention).
        along: ``[B, H_a, N, d]``: one vector per position along each line.
        heads: ``H``.
        divisor: what the products are divided by (``sqrt(d)``).
        dtype: the scores' dtype (the inputs are converted a block at a time).
        index: ``[B, T]``: the lines are ``lines``' positions ``index[b]`` (None: in order).
    """
    memo: dict[tuple[int, int], torch.Tensor] = {}

    def by_head(t: torch.Tensor, hs: slice) -> torch.Tensor:
        rep = heads // t.shape[0]
        if rep == 1:
            return t[hs]
        return t.index_select(0, torch.arange(hs.start, hs.stop, device=t.device) // rep)

    def scores(r: int, hs: slice, ls: slice, out: torch.Tensor) -> torch.Tensor:
        if (r, hs.start) not in memo:  # the blocks of one row and head group share `along`
            memo.clear()
            memo[r, hs.start] = by_head(along[r], hs).to(dtype).transpose(-1, -2)
        part = lines[r, :, ls] if index is None else lines[r].index_select(1, index[r, ls])
        torch.matmul(by_head(part, hs).to(dtype), memo[r, hs.start], out=out)
        return out.div_(divisor)

    return scores


FUSED = True
"""Whether `query_axis_sums` may take the fused CPU kernel (tests turn it off to check the
blocked path)."""


@functools.cache
def _fused_kernel():
    """PyTorch's fused CPU attention returning log-sum-exps, or None where this torch has no
    such operator (older releases) or it answers in another form."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None:
        return None
    q, k = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 3, 4)
    try:
        _, lse = op(q, k, k, 0.0, False, scale=0.5)
    except (RuntimeError, TypeError):
        return None
    return op if tuple(lse.shape) == (1, 1, 2) else None


def query_axis_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    rows: torch.Tensor,
    columns: torch.Tensor,
    dtype: torch.dtype,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per head and query row in ``rows``, the sum over key columns of the scaled products
    ``q_i . k_t / sqrt(d)`` normalised over the valid query rows: ``sum_t exp(s_it - lse_t)``
    with ``lse_t = log sum_{valid i} exp(s_it)``.

    Args:
        queries: ``[B, H, N, d]``.
        keys: ``[B, H_kv, L, d]`` (``H_kv`` divides ``H``): the columns, ``index[b]`` of them
            for row ``b`` when given, else its first ones.
        valid: ``[B, N]`` bool: the rows each column is normalised over.
        rows: ``[B, N]`` bool: the rows whose sums are wanted (others: 0 on the CPU's fused
            path, any value on the blocked one); a subset of ``valid``.
        columns: ``[B]``: how many columns each batch row reads.
        dtype: the scores' dtype (at least float32).
        index: ``[B, T]`` column positions in ``keys`` (None: in order).

    Returns:
        ``[B, H, N]`` float64 (mps: ``dtype``).
    """
    h, d = queries.shape[1], queries.shape[-1]
    op = _fused_kernel() if FUSED and queries.is_cpu else None
    if op is None:
        scores = qk_scores(keys, queries, h, math.sqrt(d), dtype, index=index)
        return column_softmax_sums(scores, h, valid, columns, dtype)
    b, n = valid.shape
    rep = h // keys.shape[1]
    total = torch.zeros(b, h, n, dtype=torch.float64, device=queries.device)
    group = max(1, min(h, block_elements(queries.device) // max(n * d, 1)))  # converted per group
    scale = 1.0 / math.sqrt(d)
    every = valid.all(dim=1).tolist()
    for r, count in enumerate(columns.tolist()):
        wanted = rows[r].nonzero().flatten()
        if count == 0 or wanted.numel() == 0:
            continue
        seen = None if every[r] else valid[r].nonzero().flatten()
        cols = torch.arange(count, device=keys.device) if index is None else index[r, :count]
        for h0 in range(0, h, group):
            heads = torch.arange(h0, min(h, h0 + group), device=keys.device)
            q = queries[r, h0 : h0 + heads.numel()]  # [g, N, d]
            k = keys[r].index_select(0, heads // rep).index_select(1, cols).to(dtype)  # [g, T, d]
            q_all = (q if seen is None else q.index_select(1, seen)).to(dtype)[None]
            # the kernel's output (attention times values) is not read: the values are the keys
            # themselves (an expanded zero tensor of no memory took it twice as long, measured)
            # pass 1: each text column's log-sum-exp over every valid query
            _, lse = op(k[None], q_all, q_all, 0.0, False, scale=scale)  # [1, g, T]
            # pass 2: the wanted rows over the text columns, each column shifted by -lse_t: one
            # more dimension, 1 on the rows and -lse_t / scale on the columns, adds -lse_t to
            # every score (3x faster than the kernel's additive-mask path, measured; the same
            # values to float rounding)
            q_rows = q.index_select(1, wanted).to(dtype)
            q_rows = torch.cat([q_rows, q_rows.new_ones(*q_rows.shape[:2], 1)], dim=-1)
            k_shift = torch.cat([k, (lse[0] / -scale).unsqueeze(-1)], dim=-1)[None]
            _, sums = op(q_rows[None], k_shift, k_shift, 0.0, False, scale=scale)  # [1, g, V]
            total[r, h0 : h0 + heads.numel(), wanted] = sums[0].double().exp()
    return total
