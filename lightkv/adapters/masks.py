"""Attention masks and token gathers for a compressed sequence: the prefill and decode
masks (4-D under sdpa and eager, 2-D padding masks under FlashAttention-2, `FLASH`),
`gather_tokens` / `gather_position_ids` (position embeddings and ids of the surviving tokens)
and `drop_padding` (trim the padding columns a `Stage` keeps).

Internals of `lightkv.adapters.session`; an adapter author does not need them.
"""

from __future__ import annotations

import torch

from ..graph.provenance import Provenance
from ..graph.scatter import right_align
from ..stage import StageResult

__all__ = [
    "FLASH",
    "decode_mask",
    "drop_padding",
    "finish_mask",
    "flash_mask",
    "gather_position_ids",
    "gather_tokens",
    "prefill_mask",
]

FLASH = "flash_attention_2"
"""The FlashAttention-2 implementation name: its kernels take a 2-D padding mask (transformers
unpads by it into varlen sequences, causal aligned bottom-right), never a 4-D one."""


def flash_mask(valid: torch.Tensor, origin: torch.Tensor | None = None) -> torch.Tensor | None:
    """The 2-D padding mask FlashAttention-2 unpads by: ``valid`` ``[B, L]`` itself, or None
    when nothing is a hole (the dense causal kernel is then exact).

    Exact only for compacted rows: holes on the left, real entries contiguous at the right in
    original order (what `drop_padding` and every compressed cache give), since the kernel
    is causal by column inside each unpadded row.

    Args:
        valid: ``[B, L]`` bool, False for holes and padding.
        origin: ``[B, L]`` original columns: given, the rows are checked (one host sync;
            prefill only, once per stage).

    Raises:
        RuntimeError: ``origin`` given and a row has a hole right of a real entry, or real
            entries out of original order.
    """
    if origin is not None:
        compact = not bool((valid[:, :-1] & ~valid[:, 1:]).any())
        # with holes only on the left, a real entry's right neighbour is real too
        ordered = compact and not bool((valid[:, :-1] & (origin[:, 1:] <= origin[:, :-1])).any())
        if not ordered:
            raise RuntimeError(
                "a compressed row has a hole between real tokens or tokens out of original order, "
                "which FlashAttention-2's causal varlen kernel cannot express; this is a lightkv "
                "bug (rows must be compacted by drop_padding): report it, or load the model with "
                "attn_implementation='sdpa'"
            )
    return None if bool(valid.all()) else valid


def finish_mask(allowed: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, Q, L]`` from ``allowed`` ``[B, Q, L]`` bool: bool under sdpa, additive float
    (0 or the dtype's minimum) under eager.

    Raises:
        ValueError: ``impl`` is `FLASH`, whose kernels take no 4-D mask.
    """
    if impl == FLASH:
        raise ValueError(
            "FlashAttention-2 takes no 4-D mask (transformers unpads by a 2-D padding mask): this "
            "mask cannot reach it; load the model with attn_implementation='sdpa'"
        )
    allowed = allowed.unsqueeze(1)
    if impl == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def prefill_mask(
    origin: torch.Tensor, valid: torch.Tensor, impl: str, dtype: torch.dtype
) -> torch.Tensor | None:
    """The 4-D mask of a compressed sequence: causal by original order, holes hidden.

    Args:
        origin: ``[B, N]`` original index of each token (``-1`` holes).
        valid: ``[B, N]`` bool, False for holes and padding.
        impl: ``"sdpa"`` (bool mask, or None when a plain causal mask is exact),
            ``"eager"`` (additive float mask) or `FLASH` (2-D padding mask).
        dtype: dtype of the additive mask.

    Returns:
        ``[B, 1, N, N]``; an invalid query row attends to itself only, so hole states
        stay finite. Under `FLASH`, `flash_mask` ``[B, N]`` or None: the row order is the
        original order, so the kernel's causal flag is causal by ``origin``.
    """
    if impl == FLASH:
        return flash_mask(valid, origin)
    if impl == "sdpa" and bool(valid.all()):
        return None
    n = origin.shape[1]
    allowed = (origin.unsqueeze(1) <= origin.unsqueeze(2)) & valid.unsqueeze(1) & valid.unsqueeze(2)
    allowed |= torch.eye(n, dtype=torch.bool, device=origin.device)
    return finish_mask(allowed, impl, dtype)


def decode_mask(
    valid: torch.Tensor, q_len: int, impl: str, dtype: torch.dtype
) -> torch.Tensor | None:
    """The 4-D mask of ``q_len`` new tokens over a compressed layer's cache.

    Args:
        valid: ``[B, L]`` validity of the cached entries followed by the new tokens
            (``L`` includes the ``q_len`` new ones).

    Returns:
        ``[B, 1, q_len, L]`` (None under sdpa for one valid token over a hole-free cache);
        under `FLASH` `flash_mask` ``[B, L]`` or None (the kernel aligns the new tokens'
        causal mask bottom-right, so ``q_len`` needs nothing more).
    """
    if impl == FLASH:
        return flash_mask(valid)
    total = valid.shape[1]
    if impl == "sdpa" and q_len == 1 and bool(valid.all()):
        return None
    past = total - q_len
    k = torch.arange(total, device=valid.device)
    qpos = past + torch.arange(q_len, device=valid.device)
    allowed = valid.unsqueeze(1) & (k.unsqueeze(0) <= qpos.unsqueeze(1)).unsqueeze(0)
    allowed |= (k.unsqueeze(0) == qpos.unsqueeze(1)).unsqueeze(0)
    return finish_mask(allowed, impl, dtype)


def _batch(t: torch.Tensor, b: int) -> torch.Tensor:
    """``t`` ``[1 or B, ...]`` expanded to batch size ``b``."""
    return t.expand(b, *t.shape[1:]) if t.shape[0] != b else t


def gather_tokens(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t`` ``[B or 1, N, ...]`` gathered along the token axis by ``index`` ``[B, M]``."""
    b, m = index.shape
    t = _batch(t, b)
    idx = index.reshape(b, m, *([1] * (t.dim() - 2))).expand(b, m, *t.shape[2:])
    return t.gather(1, idx)


def gather_position_ids(p: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """Position ids ``[B or 1, N]`` or ``[k, B or 1, N]`` (M-RoPE) gathered by ``index``."""
    if p is None:
        return None
    if p.dim() == 1:
        p = p.unsqueeze(0)
    if p.dim() == 2:
        return gather_tokens(p, index)
    if p.dim() == 3:
        k, b = p.shape[0], index.shape[0]
        p = p.expand(k, b, p.shape[2]) if p.shape[1] != b else p
        return p.gather(2, index.unsqueeze(0).expand(k, -1, -1))
    raise ValueError(f"unsupported position_ids shape {tuple(p.shape)}")


def drop_padding(result: StageResult) -> StageResult:
    """The same result without padding columns it does not need.

    A `Stage` keeps every non-removed token, including input padding and holes left by
    earlier stages (kind PAD), so a padded row keeps the batch as wide as the prompt. This
    drops PAD tokens and re-aligns each row's real tokens to the right (holes on the left,
    as few as the longest row needs). Only gathers: hidden states are not changed. A no-op
    when the result has no removable padding.
    """
    keep = result.layout.valid_mask
    if int(keep.sum(dim=1).max()) == keep.shape[1]:
        return result
    index, col = right_align(keep)  # new column -> old, old column -> new
    width = index.shape[1]
    hole = index < 0
    hidden = gather_tokens(result.hidden, index.clamp_min(0)).masked_fill(hole.unsqueeze(-1), 0)
    kept_index = result.kept_index.gather(1, index.clamp_min(0)).masked_fill(hole, -1)

    def through(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t >= 0, col.gather(1, t.clamp_min(0)), t)

    owner = through(result.provenance.owner)
    return StageResult(
        hidden=hidden,
        layout=result.layout.select(index),
        kept_index=kept_index,
        provenance=Provenance(owner, width),
        remap=through(result.remap),
    )


def _last_valid(valid: torch.Tensor) -> torch.Tensor:
    """``[B]`` column of the last True in each row of ``valid`` ``[B, N]``."""
    n = valid.shape[1]
    return (valid.long() * torch.arange(1, n + 1, device=valid.device)).argmax(dim=1)
