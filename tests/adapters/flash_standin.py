"""A test-only, pure-torch stand-in with FlashAttention-2's contract, so that lightkv's
``flash_attention_2`` path runs (and is checked) on a CPU.

What it reproduces of ``transformers.integrations.flash_attention.flash_attention_forward``
and ``modeling_flash_attention_utils._flash_attention_forward`` (transformers 5.24), written
from their contract, not from their code, and sharing nothing with lightkv:

* the mask builder hands the layers a 2-D padding mask ``[B, kv_len]`` (True = real), or
  ``None`` when no entry is padding; a 4-D mask is refused (the kernel has no place for it);
* with a 2-D mask the keys and values are unpadded by it and the queries by its last
  ``q_len`` columns (all queries when ``q_len == 1``), each row attends as one varlen
  sequence, and padded query rows come out as zeros;
* without a mask: pre-computed ``cu_seq_lens_q/k`` (vision towers' packed images), or at
  batch 1 position ids that are not ``min .. min + L - 1`` split the row into packed
  sequences starting where the position equals its minimum; else each row is dense;
* causal attention is aligned bottom-right: query ``i`` of ``q`` over ``k`` keys sees keys
  ``j <= i + k - q`` (FlashAttention >= 2.1, what decoding relies on).

Everything runs in the inputs' dtype (float32 / float64 here), so its result equals
``sdpa``'s to rounding. `FlashStandIn.counts` tells what it saw (calls, varlen calls, 4-D
masks, masks built, causal layers run with the causal flag off).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

NAME = "flash_attention_2"
"""The implementation name lightkv checks (the one transformers loads FlashAttention-2 under)."""


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    """One sequence: ``q`` ``[Lq, H, D]``, ``k``/``v`` ``[Lk, H, D]`` -> ``[Lq, H, D]``."""
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        qi = torch.arange(lq, device=q.device).unsqueeze(1)
        kj = torch.arange(lk, device=q.device).unsqueeze(0)
        logits = logits.masked_fill(kj > qi + (lk - lq), float("-inf"))  # bottom-right alignment
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), v)


def _segments(bounds: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` from cumulative lengths ``[n + 1]``."""
    b = [int(x) for x in bounds]
    return list(zip(b[:-1], b[1:]))


class FlashStandIn:
    """The stand-in's attention function and mask builder, with counters."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ mask builder
    def mask(
        self,
        batch_size,
        q_length,
        kv_length,
        q_offset=0,
        kv_offset=0,
        mask_function=None,
        attention_mask=None,
        **kwargs,
    ):
        """FlashAttention's mask: the 2-D padding mask cut to the keys, or None without padding."""
        self.counts["masks_built"] += 1
        if attention_mask is None:
            return None
        attention_mask = attention_mask[:, -kv_length:]
        return (
            None
            if attention_mask.shape[1] == kv_length and bool(attention_mask.all())
            else attention_mask
        )

    # ------------------------------------------------------------------ attention
    def attention(
        self,
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0,
        scaling=None,
        sliding_window=None,
        softcap=None,
        is_causal=None,
        s_aux=None,
        **kwargs,
    ):
        """``query`` ``[B, H, Lq, D]``, ``key``/``value`` ``[B, Hkv, Lk, D]`` ->
        ``([B, Lq, H, D], None)``."""
        self.counts["calls"] += 1
        if attention_mask is not None and attention_mask.dim() != 2:
            self.counts["masks_4d"] += 1
            raise TypeError(
                f"FlashAttention-2 takes a 2-D padding mask, got {attention_mask.dim()}-D"
            )
        if sliding_window not in (None, -1) or softcap or s_aux is not None or dropout:
            raise NotImplementedError(
                "the stand-in has no sliding window, softcap, sinks or dropout"
            )
        causal = module.is_causal if is_causal is None else is_causal
        if module.is_causal and not causal:
            self.counts["causal_off"] += (
                1  # a causal layer run both ways (the released first merge)
            )
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, L, H, D]
        rep = q.shape[2] // k.shape[2]  # grouped-query attention: one kv head serves `rep` heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        b, lq, lk = q.shape[0], q.shape[1], k.shape[1]
        out = torch.zeros_like(q)
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        pos = kwargs.get("position_ids")
        if attention_mask is not None:
            self.counts["varlen"] += 1
            if attention_mask.shape[1] != lk:
                raise ValueError(f"a 2-D mask of {attention_mask.shape[1]} columns for {lk} keys")
            m = attention_mask.bool()
            for r in range(b):
                keys = m[r].nonzero().flatten()
                rows = (
                    keys
                    if lq == lk
                    else torch.zeros(1, dtype=torch.long)
                    if lq == 1
                    else m[r, -lq:].nonzero().flatten()
                )
                out[r, rows] = _attend(q[r, rows], k[r, keys], v[r, keys], causal, scale)
        elif cu_q is not None and cu_k is not None:
            self.counts["varlen"] += 1
            qf, kf, vf, of = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v, out))
            for (qs, qe), (ks, ke) in zip(_segments(cu_q), _segments(cu_k)):
                of[qs:qe] = _attend(qf[qs:qe], kf[ks:ke], vf[ks:ke], causal, scale)
            out = of.view_as(q)
        elif pos is not None and b == 1 and lq > 1 and _packed(pos.reshape(-1)):
            if lq != lk:  # transformers would split queries and keys by the same bounds: wrong
                raise ValueError(f"packed position ids for {lq} queries over {lk} keys")
            self.counts["varlen"] += 1
            p = pos.reshape(-1)
            starts = (p == p.min()).nonzero().flatten().tolist() + [lq]
            for s, e in zip(starts[:-1], starts[1:]):
                out[0, s:e] = _attend(q[0, s:e], k[0, s:e], v[0, s:e], causal, scale)
        else:
            for r in range(b):
                out[r] = _attend(q[r], k[r], v[r], causal, scale)
        return out, None

    # ------------------------------------------------------------------ registration
    @contextmanager
    def registered(self):
        """Register under `NAME` in transformers' attention and mask registries (public
        ``register``), and put back what was there on exit."""
        old_fn = AttentionInterface._global_mapping.get(NAME)
        old_mask = AttentionMaskInterface._global_mapping.get(NAME)
        AttentionInterface.register(NAME, self.attention)
        AttentionMaskInterface.register(NAME, self.mask)
        try:
            yield self
        finally:
            for reg, old in ((AttentionInterface, old_fn), (AttentionMaskInterface, old_mask)):
                if old is None:
                    reg._global_mapping.pop(NAME, None)
                else:
                    reg.register(NAME, old)


def _packed(p: torch.Tensor) -> bool:
    """Position ids of one row that are not ``min, min + 1, ...`` (transformers' test)."""
    return bool((torch.arange(p.numel(), device=p.device) + p.min() != p).any())


def use_flash(model, impl: str = NAME) -> None:
    """Switch ``model`` (every config) to ``impl`` without transformers' check that the
    flash_attn package is installed (the stand-in replaces it)."""
    model.config._attn_implementation = impl  # the setter sets every sub-config too
