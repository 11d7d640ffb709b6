"""Gemma 3 (``Gemma3ForConditionalGeneration``): one square grid per image (pan & scan
crops are further images), bidirectional attention inside each image, sliding-window layers.

Each image (and each pan & scan crop) becomes ``config.mm_tokens_per_image`` consecutive
placeholder tokens (``config.image_token_id``; 256 = a 16 x 16 grid after the projector's
average pooling), filled in raster order, wrapped by the processor in ``<start_of_image>``
/ ``<end_of_image>`` text tokens. With ``token_type_ids`` the model lets the tokens of one
contiguous image run attend to each other both ways (``OR(causal, same block)``); without
them it is causal. Sliding layers (5 of every 6) AND that with a window over sequence
columns: a query at column ``q`` sees keys at columns ``> q - sliding_window``.

After a compression stage the adapter rebuilds both masks from the *original* columns of
the surviving tokens: survivors of one image run still see each other both ways, and the
window is measured in original columns (prompt columns, then prompt length + step while
decoding), so a token leaves a sliding layer's window when the unhooked model's would. A
compressed sliding layer's cache keeps all its (fewer) entries and hides those outside the
window by the mask (so it is not bounded by the window: a memory cost, not an error);
uncompressed layers keep transformers' own sliding-window cache. Relevance at a scheduled
sliding layer is scored over the whole prompt (a policy heuristic; the window is not applied).

Exact: images and pan & scan crops, bidirectional image blocks, sliding windows (over original
  positions).
Refused: ``use_bidirectional_attention`` text configs, other layer types, non-square
  ``mm_tokens_per_image``;
FlashAttention-2 (transformers' Gemma 3 has no FlashAttention-2 path, and a padding mask can carry
neither both-ways image blocks nor windows in original columns).
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..graph.layout import ImageSegment
from .base import Adapter, place_images
from .masks import finish_mask

__all__ = ["Gemma3Adapter", "block_ids"]

_TYPES = ("full_attention", "sliding_attention")


def block_ids(token_type_ids: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` index of the bidirectional block of each column (``-1`` for text): one
    block per maximal run of ``token_type_ids == 1``, as the model numbers them."""
    is_image = token_type_ids == 1
    prev = torch.nn.functional.pad(is_image, (1, 0), value=False)[:, :-1]
    starts = torch.cumsum((is_image & ~prev).long(), dim=1) - 1
    return torch.where(is_image, starts, torch.full_like(starts, -1))


class Gemma3Adapter(Adapter):
    """Gemma 3: a ``side x side`` grid per image or crop, image blocks bidirectional,
    sliding-window layers windowed over original positions."""

    family = "gemma3"
    model_types = ("gemma3",)
    cache_layer_types = (DynamicLayer, DynamicSlidingWindowLayer)
    flash_attention_refused = (
        "transformers' Gemma 3 has no FlashAttention-2 path, and a 2-D padding mask can carry "
        "neither its both-ways image blocks nor sliding windows measured in original columns"
    )

    def check_config(self) -> None:
        tc = self.text_config()
        if getattr(tc, "use_bidirectional_attention", False):
            raise NotImplementedError(
                "the gemma3 adapter needs a causal decoder; this text config has "
                "use_bidirectional_attention=True (every token attends both ways), which "
                "lightkv's compressed masks do not implement"
            )
        bad = sorted(set(tc.layer_types) - set(_TYPES))
        if bad:
            raise NotImplementedError(
                f"the gemma3 adapter supports layer types {_TYPES}; this model also has {bad}"
            )
        n = int(self.config.mm_tokens_per_image)
        if math.isqrt(n) ** 2 != n:
            raise NotImplementedError(
                f"the gemma3 adapter needs a square image grid; mm_tokens_per_image={n}"
            )
        self._blocks: torch.Tensor | None = None

    def _side(self) -> int:
        return math.isqrt(int(self.config.mm_tokens_per_image))

    def build_layout(self, inputs, padding):
        input_ids = inputs["input_ids"]
        # read by the masks of this prefill (build_layout runs first, at every prefill)
        tti = inputs.get("token_type_ids")
        self._blocks = block_ids(tti.to(input_ids.device)) if tti is not None else None
        placeholders = input_ids == self.config.image_token_id
        n = int(placeholders.sum())
        if n == 0:
            return None
        side = self._side()
        per_image = side * side
        if n % per_image:
            raise ValueError(
                f"{n} image tokens is not a multiple of {per_image} tokens per image "
                f"({side}x{side} grid)"
            )
        places = place_images(placeholders, [per_image] * (n // per_image))
        segments = [ImageSegment(row=r, offset=o, grid=(side, side)) for r, o in places]
        return self.layout_from_segments(input_ids, segments, padding)

    # ---------------------------------------------------------------- masks
    def _window(self, layer: int) -> int | None:
        tc = self.text_config()
        return int(tc.sliding_window) if tc.layer_types[layer] == "sliding_attention" else None

    def check_cache_layers(self, layers):
        sliding = [i for i in layers if self._window(i) is not None]
        if sliding:
            full = [
                i for i, t in enumerate(self.text_config().layer_types) if t != "sliding_attention"
            ]
            raise NotImplementedError(
                "the cache mode (cache stages, H2O) does not support Gemma 3's sliding-window "
                f"layers {sliding}: a merged or kept entry's place in a sliding window has no "
                f"single meaning; list only full-attention layers ({full})"
            )

    def mask_key(self, layer: int):
        return self.text_config().layer_types[layer]

    def prefill_mask(self, layer, origin, valid, impl, dtype):
        oq, ok = origin.unsqueeze(2), origin.unsqueeze(1)
        allowed = ok <= oq
        if self._blocks is not None:
            if self._blocks.shape[0] != origin.shape[0]:
                raise RuntimeError(
                    "token_type_ids and the compressed batch disagree on the batch size"
                )
            blk = (
                self._blocks.to(origin.device)
                .gather(1, origin.clamp_min(0))
                .masked_fill(origin < 0, -1)
            )
            allowed = allowed | ((blk.unsqueeze(2) == blk.unsqueeze(1)) & (blk.unsqueeze(2) >= 0))
        window = self._window(layer)
        if window is not None:
            allowed = allowed & (ok > oq - window)
        allowed = allowed & valid.unsqueeze(1) & valid.unsqueeze(2)
        allowed |= torch.eye(origin.shape[1], dtype=torch.bool, device=origin.device)
        return finish_mask(allowed, impl, dtype)

    def decode_mask(self, layer, origin, valid, q_len, impl, dtype):
        window = self._window(layer)
        if window is None:
            return super().decode_mask(layer, origin, valid, q_len, impl, dtype)
        if origin is None:
            raise RuntimeError(
                f"compressed sliding layer {layer} has no record of its entries' positions"
            )
        total = valid.shape[1]
        past = total - q_len
        oq = origin[:, past:].unsqueeze(2)
        ok = origin.unsqueeze(1)
        allowed = valid.unsqueeze(1) & (ok <= oq) & (ok > oq - window)
        k = torch.arange(total, device=valid.device)
        allowed |= (
            k.unsqueeze(0) == past + torch.arange(q_len, device=valid.device).unsqueeze(1)
        ).unsqueeze(0)
        return finish_mask(allowed, impl, dtype)
