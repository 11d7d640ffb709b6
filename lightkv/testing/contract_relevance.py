"""The contract of a relevance policy (`lightkv.testing.check_policy` runs it): the shape
and range of ξ, batch rows as alone, and that `Relevance.score` reads only the query rows and
key columns it declares (``query_rows``, ``key_cols``, ``packed_text_keys``), since an
adapter projects nothing else."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..graph.layout import VisionLayout
from ..graph.scatter import pack_rows
from ..policies import Relevance, StageInputs
from ..policies.prompt import Prompt

__all__ = ["check_relevance"]


def check_relevance(
    policy: Relevance,
    inputs: StageInputs,
    heads: int,
    head_dim: int,
    fail: Callable[[Any, str], AssertionError],
) -> None:
    """`Relevance.score` on ``inputs``' layout with random queries (``2 x heads`` heads) and
    keys (``heads``): ``[B, N]``, finite, non-negative, each row as alone, and from the
    rows and columns the policy declares alone as from all of them."""
    b, n = inputs.batch_size, inputs.seq_len
    gen = torch.Generator().manual_seed(2)
    queries = torch.randn(b, 2 * heads, n, head_dim, generator=gen)
    keys = torch.randn(b, heads, n, head_dim, generator=gen)
    extra: dict[str, Any] = {}
    if policy.reads_prompt:  # token ids of the contract batch: text ids 5.., vision tokens 3
        ids = torch.where(inputs.layout.vision_mask, 3, 5 + torch.arange(n).expand(b, n) % 7)
        extra = {"prompt": Prompt(ids)}
    if policy.reads_tower:  # attention received inside the vision tower, per head
        extra["tower"] = torch.rand(b, heads, n, generator=gen)
    if policy.reads_hidden:  # the residual stream the stage reads
        extra["hidden"] = torch.randn(b, n, 2 * heads * head_dim, generator=gen)
    xi = policy.score(queries, keys, inputs.layout, **extra)
    _check_declared_reads(policy, queries, keys, inputs.layout, extra, xi, fail)
    if tuple(xi.shape) != (b, n):
        raise fail(policy, f"score() must return [B, N] = {(b, n)}, got {tuple(xi.shape)}")
    if not xi.is_floating_point() or not torch.isfinite(xi).all() or (xi < 0).any():
        raise fail(policy, "relevance must be finite and non-negative")
    for r in range(b):
        one = {"prompt": Prompt(extra["prompt"].token_ids[r : r + 1])} if "prompt" in extra else {}
        for name in ("tower", "hidden"):
            if name in extra:
                one[name] = extra[name][r : r + 1]
        alone = policy.score(queries[r : r + 1], keys[r : r + 1], inputs.layout.row(r), **one)
        vision = inputs.layout.vision_mask[r]
        if not torch.allclose(alone[0][vision], xi[r][vision], rtol=1e-5, atol=1e-7):
            raise fail(policy, f"row {r}'s relevance differs in the batch and alone")


def _as_an_adapter_gives(
    policy: Relevance, queries: torch.Tensor, keys: torch.Tensor, layout: VisionLayout
) -> list[tuple[str, torch.Tensor | None, torch.Tensor | None]]:
    """The queries and keys an adapter hands `Relevance.score` for the rows and columns the
    policy declares (`lightkv.adapters.features.relevance`): None for ``"none"``; zeros in
    the rows and columns it does not project; with ``packed_text_keys`` also the text
    columns packed ``[B, H_kv, T, d]``. Each as ``(what, queries, keys)``."""
    b, n = layout.batch_size, layout.seq_len
    rows, cols = policy.query_rows, policy.key_cols
    if rows == "none":
        q = None
    elif rows == "last":
        last = (layout.valid_mask.long() * torch.arange(1, n + 1)).argmax(dim=1)
        keep = torch.zeros(b, n, dtype=torch.bool)
        keep[torch.arange(b), last] = True
        q = queries * keep[:, None, :, None]
    else:
        q = queries
    if cols == "none":
        k = None
    elif cols == "text":
        k = keys * layout.text_mask[:, None, :, None]
    else:
        k = keys
    out = [(f"query_rows={rows!r}, key_cols={cols!r}", q, k)]
    if cols == "text" and policy.packed_text_keys:
        pos, _ = pack_rows(layout.text_mask)
        index = pos[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
        out.append(("packed_text_keys=True: the text columns packed", q, keys.gather(2, index)))
    return out


def _check_declared_reads(
    policy: Relevance,
    queries: torch.Tensor,
    keys: torch.Tensor,
    layout: VisionLayout,
    extra: dict[str, Any],
    full: torch.Tensor,
    fail: Callable[[Any, str], AssertionError],
) -> None:
    """`Relevance.score` reads only the query rows and key columns the policy declares
    (``query_rows``, ``key_cols``, ``packed_text_keys``): an adapter projects nothing else,
    so ξ from those alone equals ξ from every row and column."""
    vision = layout.vision_mask
    for what, q, k in _as_an_adapter_gives(policy, queries, keys, layout):
        try:
            xi = policy.score(q, k, layout, **extra)
        except Exception as e:  # noqa: BLE001 - any failure here is the policy's contract
            raise fail(
                policy,
                f"score() fails on what an adapter gives for {what} "
                f"({type(e).__name__}: {e}): it reads rows or columns it does not declare",
            ) from None
        if tuple(xi.shape) != tuple(full.shape) or not torch.allclose(
            xi[vision], full[vision], rtol=1e-5, atol=1e-7
        ):
            raise fail(
                policy,
                f"score() differs when given only what it declares ({what}): it reads query "
                "rows or key columns an adapter does not project; declare them",
            )
