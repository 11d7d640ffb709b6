"""Relevance: how much each vision token matters to the text prompt (ξ).

Relevance policies here take plain tensors (queries and keys of one layer) and a layout,
so they are testable without a model; adapters compute the queries and keys from a
layer's own projections. None of them needs the ``N x N`` attention matrix: each says
which query rows (`query_rows`) and key columns (`key_cols`) it reads, so an adapter can
project only those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..graph.layout import VisionLayout
from ..graph.scatter import pack_rows
from .base import Policy
from .hashing import seeded_uniform, seeded_uniform_pairs, token_identity
from .softmax_sums import (
    block_elements,
    column_softmax_sums,
    qk_scores,
    query_axis_sums,
    row_softmax_sums,
)

__all__ = [
    "Relevance",
    "QueryAxisSoftmax",
    "LastTokenAttention",
    "TextQueryAttention",
    "UniformRelevance",
    "RandomRelevance",
]

Heads = Literal["sum", "mean", "max"]
HEADS: tuple[str, ...] = ("sum", "mean", "max")
"""How per-head relevance becomes one ξ: ``sum`` and ``mean`` differ by the factor ``H``
only (the same rankings and the same merge weights; the scale matters only to a policy
that compares ξ across layers or thresholds it), ``max`` takes the head that attends
most to each token (another ranking)."""


def _check_heads(heads: str) -> None:
    if heads not in HEADS:
        raise ValueError(f"unknown heads {heads!r}; choose one of {', '.join(HEADS)}")


def _reduce_heads(x: torch.Tensor, heads: str) -> torch.Tensor:
    """``[B, H, N]`` -> ``[B, N]``: sum, mean or max over the head axis."""
    if heads == "sum":
        return x.sum(dim=1)
    if heads == "mean":
        return x.mean(dim=1)
    return x.amax(dim=1)


def _kv_ratio(keys: torch.Tensor, heads: int) -> int:
    """Query heads per key head (grouped-query attention)."""
    if heads % keys.shape[1]:
        raise ValueError(f"query heads ({heads}) must be a multiple of key heads ({keys.shape[1]})")
    return heads // keys.shape[1]


def _match_heads(keys: torch.Tensor, heads: int) -> torch.Tensor:
    if keys.shape[1] == heads:
        return keys
    return keys.repeat_interleave(_kv_ratio(keys, heads), dim=1)


def _accumulator(t: torch.Tensor) -> torch.dtype:
    """At least float32, never below the input (float64 stays float64): half-precision
    softmax over thousands of queries loses the small relevance differences that rank tokens."""
    return torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else torch.float32


class Relevance(Policy):
    """Family: prompt relevance ξ per vision token. Override `score`."""

    family: ClassVar[str] = "relevance"
    query_rows: ClassVar[Literal["all", "last", "none"]] = "all"
    """Which query rows `score` reads: every token, only the last one, or none."""
    key_cols: ClassVar[Literal["text", "all", "none"]] = "text"
    """Which key columns `score` reads: text tokens only, every token, or none."""
    packed_text_keys: ClassVar[bool] = False
    """With ``key_cols == "text"``: whether `score` also takes the text columns' keys
    packed, ``[B, H_kv, T, d]`` in the order of `lightkv.graph.scatter.pack_rows` of
    ``layout.text_mask`` (``T < N``: the most text tokens of any row), which adapters then
    pass instead of a full-length ``[B, H_kv, N, d]`` tensor that is zero outside the text
    columns (tens of MB per stage at 7B width)."""
    reads_prompt: ClassVar[bool] = False
    """Whether `score` also takes ``prompt=`` (a `lightkv.policies.Prompt`: the prefill's
    token ids), for policies conditioned on what the prompt says (see
    `lightkv.policies.QuestionAttention`)."""
    reads_tower: ClassVar[bool] = False
    """Whether `score` also takes ``tower=`` (``[B, H, N]``: the attention each token
    receives inside the vision tower, which the adapter computes), for policies that rank
    tokens as the vision encoder does (see `lightkv.methods.TowerAttention`)."""

    def score(
        self, queries: torch.Tensor | None, keys: torch.Tensor | None, layout: VisionLayout
    ) -> torch.Tensor:
        """Relevance per token.

        Args:
            queries: ``[B, H, N, d]`` post-RoPE queries of the layer (or None if
                ``query_rows == "none"``).
            keys: ``[B, H_kv, N, d]`` post-RoPE keys (``H`` a multiple of ``H_kv``).
            layout: the batch layout.

        Returns:
            ``[B, N]`` non-negative, at least float32 (float64 for float64 inputs), zero
            outside vision tokens.
        """
        raise NotImplementedError

    reads_hidden: ClassVar[bool] = False
    """Whether `score` also takes ``hidden=`` (``[B, N, D]``: the hidden states the stage
    reads; before the LLM the input embeddings), for policies that compare tokens in the
    residual stream instead of projecting queries and keys (see
    `lightkv.methods.QuestionSimilarity`)."""

    def hidden_flops(self, layout: VisionLayout, hidden_size: int, prompt=None) -> float:
        """FLOPs `score` spends on ``hidden=`` (a policy that `reads_hidden`; 0 otherwise)."""
        return 0.0

    def product_flops(self, layout: VisionLayout, heads: int, head_dim: int) -> float | None:
        """Multiply-add FLOPs (2 per MAC) of the ``q . k`` products `score` computes on
        ``layout`` with ``heads`` query heads, or None: every query row it reads times every
        key column it reads (what `lightkv.adapters.features.relevance` then counts)."""
        return None

    @staticmethod
    def _check(
        queries: torch.Tensor, keys: torch.Tensor, layout: VisionLayout, packed: int | None = None
    ) -> None:
        if queries.dim() != 4 or keys.dim() != 4:
            raise ValueError("queries and keys must be [B, H, N, d]")
        b, _, n, d = queries.shape
        if (
            (b, n) != (layout.batch_size, layout.seq_len)
            or keys.shape[0] != b
            or keys.shape[2] not in (n, packed)
        ):
            raise ValueError(
                f"queries {tuple(queries.shape)} / keys {tuple(keys.shape)} do not match the "
                f"layout [B={layout.batch_size}, N={layout.seq_len}]"
            )
        if keys.shape[-1] != d:
            raise ValueError(
                f"queries and keys need the same head dim, got {d} and {keys.shape[-1]}"
            )


@Relevance.register("query_softmax")
@dataclass
class QueryAxisSoftmax(Relevance):
    """The LightKV reference code's relevance (Chen, Guo, Zimmermann, TMLR 2026,
    arXiv:2605.00789).

    Pre-mask logits ``q_i . k_t / sqrt(d)`` with every token ``i`` as query and every text
    token ``t`` as key (including the question after the image, which the causal mask would
    hide); softmax over the *query* axis (each text column normalised over all valid query
    positions); keep the vision rows; sum over text columns, then over heads (``heads``).
    Computes ``N x T`` scores per head, a block of columns at a time
    (`lightkv.policies.softmax_sums`): its working set is one block, never ``N x T``.

    Attributes:
        heads: ``sum`` (the reference code), ``mean`` or ``max`` over query heads.
    """

    heads: Heads = "sum"
    packed_text_keys: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_heads(self.heads)

    def score(self, queries, keys, layout):
        text_pos, text_valid = pack_rows(layout.text_mask)
        self._check(queries, keys, layout, packed=text_pos.shape[1])
        _kv_ratio(keys, queries.shape[1])
        # the text columns' keys: packed already (`packed_text_keys`) or read at their positions
        index = None if keys.shape[2] != layout.seq_len else text_pos
        acc = _accumulator(queries)
        # each text column normalised over the valid queries, a block of columns (or the fused
        # kernel's tiles) at a time: never the H x N x T scores at once
        rows = layout.vision_mask & layout.valid_mask
        per_head = query_axis_sums(
            queries, keys, layout.valid_mask, rows, text_valid.sum(1), acc, index=index
        )
        xi = _reduce_heads(per_head, self.heads).to(acc)
        return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))


@Relevance.register("last_token")
@dataclass
class LastTokenAttention(Relevance):
    """Attention from the last prompt token to every token, averaged over heads.

    FastV's importance score (Chen et al., ECCV 2024, arXiv:2403.06764).

    The last token is the last valid position of each row (left or right padding both
    work). Softmax over all valid keys, as in the causal model (the last token sees all).

    Attributes:
        heads: ``mean`` (FastV), ``sum`` or ``max`` over query heads.
    """

    query_rows = "last"
    key_cols = "all"
    heads: Heads = "mean"

    def __post_init__(self) -> None:
        _check_heads(self.heads)

    def score(self, queries, keys, layout):
        self._check(queries, keys, layout)
        valid = layout.valid_mask
        last = (valid.long() * torch.arange(1, layout.seq_len + 1, device=valid.device)).argmax(
            dim=1
        )
        h, d = queries.shape[1], queries.shape[-1]
        q_last = queries.gather(2, last[:, None, None, None].expand(-1, h, 1, d))  # [B,H,1,d]
        k = _match_heads(keys, h)
        acc = _accumulator(queries)
        logits = torch.matmul(q_last.to(acc), k.to(acc).transpose(-1, -2)) / math.sqrt(
            d
        )  # [B,H,1,N]
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        xi = _reduce_heads(torch.softmax(logits, dim=-1)[:, :, 0], self.heads)
        return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))


@Relevance.register("text_attention")
@dataclass
class TextQueryAttention(Relevance):
    """Attention from every text token to each vision token: the model's own attention rows
    (softmax over the *key* axis) for the text queries, summed over them, then over heads.

    Where ``query_softmax`` normalises each text column over all queries and ``last_token``
    reads one query row, this reads every text row: the whole question, and with
    ``causal=False`` also the text before the image. With ``causal=True`` (the model's
    mask) a query sees the valid keys at or before its original position, so text before
    the image contributes nothing. Computes ``T x N`` scores per head, a block of rows at a
    time (its working set is one block, `lightkv.policies.softmax_sums`); it declares
    ``query_rows = "all"`` (adapters offer no text-rows option), so an adapter projects
    every query row.

    Attributes:
        heads: ``mean``, ``sum`` or ``max`` over query heads.
        causal: the causal mask (True) or every valid key for every text query (False).
    """

    query_rows = "all"
    key_cols = "all"
    heads: Heads = "mean"
    causal: bool = True

    def __post_init__(self) -> None:
        _check_heads(self.heads)

    def score(self, queries, keys, layout):
        """``queries [B, H, N, d]``, ``keys [B, H_kv, N, d]`` -> ``[B, N]``."""
        self._check(queries, keys, layout)
        return attention_from_rows(queries, keys, layout, layout.text_mask, self.heads, self.causal)


def attention_from_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    layout: VisionLayout,
    rows: torch.Tensor,
    heads: str = "mean",
    causal: bool = True,
) -> torch.Tensor:
    """Attention that the query rows ``rows`` (bool ``[B, N]``) pay each token (softmax over
    the valid keys, at or before the row's original position when ``causal``), summed over
    those rows, then reduced over heads; zero outside vision tokens. ``T x N`` scores per
    head (``T`` the most rows any batch row has), a block of rows at a time: never ``N x N``
    or ``T x N`` at once."""
    pos, valid = pack_rows(rows)  # [B, T]
    h, d = queries.shape[1], queries.shape[-1]
    _kv_ratio(keys, h)
    acc = _accumulator(queries)
    seen = layout.valid_mask
    origin = layout.origin

    def allowed(r: int, lines: slice) -> torch.Tensor:  # [c, N]: what each read row may see
        at = pos[r, lines]
        ok = seen[r].unsqueeze(0) & valid[r, lines].unsqueeze(1)
        return ok & (origin[r].unsqueeze(0) <= origin[r, at].unsqueeze(1)) if causal else ok

    # a block of rows at a time (`row_softmax_sums`): never the H x T x N scores at once
    scores = qk_scores(queries, keys, h, math.sqrt(d), acc, index=pos)
    per_head = row_softmax_sums(scores, h, allowed, valid.sum(1), layout.seq_len, acc)
    xi = _reduce_heads(per_head, heads).to(acc)
    return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))


@Relevance.register("uniform")
@dataclass
class UniformRelevance(Relevance):
    """ξ = 1 for every vision token: prompt-agnostic merging (ToMe, or LightKV with
    relevance switched off)."""

    query_rows = "none"
    key_cols = "none"

    def score(self, queries, keys, layout):
        return layout.vision_mask.float()


@Relevance.register("random")
@dataclass
class RandomRelevance(Relevance):
    """The authors' released LLaVA code's relevance: `QueryAxisSoftmax` with its scores
    replaced by random numbers (the ``lightkv-paper-released`` preset).

    The released hook replaces the attention scores of the relevance module by
    ``torch.rand_like`` (a leftover marked "TODO: REMOVE THIS"), and those scores then go
    through the module's own softmax over the query axis and its sums over text columns
    and heads. Summing ``H x T`` softmax entries of uniform scores makes ξ nearly constant
    (coefficient of variation about ``0.28 / sqrt(H T)``: 0.01-0.02 on LLaVA-1.5-7B), so the
    released merges are near-plain averages; ξ uniform in ``[0, 1)`` itself (CV 0.58) merged
    24-72x further from the released code's features than one released run is from another.
    ``softmax=False`` keeps that raw draw (for ablations).

    The released code draws from the global RNG, so its runs differ from each other; here
    each score is a hash of its token's grid position, head, text column and ``seed``
    (`lightkv.policies.hashing.seeded_uniform_pairs`), so a row gets the same ξ alone or
    inside a batch and on every run: the released distribution, not its numbers. The
    queries are read for their head count only (the released code computed them too).

    Attributes:
        seed: changes the draw.
        softmax: pass the scores through the module's softmax and sums (the released code).
    """

    key_cols = "text"
    packed_text_keys: ClassVar[bool] = True
    seed: int = 0
    softmax: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.softmax, bool):
            raise ValueError(f"softmax must be True or False, got {self.softmax!r}")

    def score(self, queries, keys, layout):
        identity = token_identity(layout)
        if not self.softmax:
            xi = seeded_uniform(identity, self.seed)
            return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))
        text_pos, text_valid = pack_rows(layout.text_mask)
        heads = 1 if queries is None else int(queries.shape[1])
        # a text token is known by its place among its row's real tokens (not its padded index)
        rank = layout.valid_mask.long().cumsum(1) - 1
        identity = torch.where(layout.image >= 0, identity, rank)
        text_identity = identity.gather(1, text_pos)

        def scores(r: int, hs: slice, ls: slice, out: torch.Tensor) -> torch.Tensor:
            draw = seeded_uniform_pairs(
                identity[r : r + 1],
                text_identity[r : r + 1, ls],
                hs.stop - hs.start,
                self.seed,
                first_head=hs.start,
            )  # [1, g, N, c]
            return out.copy_(draw[0].transpose(1, 2))

        # then what the released module does with its (replaced) scores: QueryAxisSoftmax's softmax
        # and sums, a block of text columns at a time
        # blocks an eighth of the usual: each float64 draw passes through int64 hashes its size
        block = block_elements(layout.valid_mask.device) // 8
        per_head = column_softmax_sums(
            scores, heads, layout.valid_mask, text_valid.sum(1), torch.float64, block
        )
        xi = per_head.sum(dim=1)
        return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))
