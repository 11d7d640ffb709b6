"""Proportional attention (ToMe, Bolya et al., ICLR 2023) inside a session: every layer
after a merge adds ``log(size)`` of each key column to its attention logits, so a token
that stands for ``k`` original tokens gets the attention weight of ``k`` copies of itself
(softmax over ``k`` equal keys = one key with logit ``+ log k``).

Internals of `lightkv.adapters.session` (`lightkv.Pipeline.proportional_attention`). The
bias rides on the additive (float) 4-D mask the session already hands every compressed
layer, under ``sdpa`` as under ``eager``: the family's own mask (`Adapter.prefill_mask`,
`Adapter.decode_mask`, asked for its ``eager`` form) plus ``log(size)`` per key column.
Sizes come from the provenance of the stages so far (prefill) and from the layer's
`MaskedCacheLayer.sizes` (decoding). While no token stands for more than one, nothing is
changed: the masks are exactly those without the option.
"""

from __future__ import annotations

import torch

from ..graph.layout import VisionLayout
from ..graph.provenance import Provenance
from .base import Adapter
from .cache import MaskedCacheLayer

__all__ = ["ProportionalAttention", "add_log_sizes"]


def add_log_sizes(mask: torch.Tensor | None, sizes: torch.Tensor, family: str) -> torch.Tensor:
    """An additive mask with ``log(size)`` added to every key column.

    Args:
        mask: ``[B, 1, Q, L]`` float additive mask (the ``eager`` form of a family's mask).
        sizes: ``[B, L]`` original tokens per key column (holes: 0, counted as 1; they are
            masked anyway).
        family: the adapter's family, for the error message.

    Returns:
        ``[B, 1, Q, L]`` in ``mask``'s dtype.

    Raises:
        TypeError: the family's mask is not a float tensor of that shape, so the bias has
            nowhere to go.
    """
    if (
        not isinstance(mask, torch.Tensor)
        or not mask.is_floating_point()
        or mask.dim() != 4
        or mask.shape[-1] != sizes.shape[1]
        or mask.shape[0] != sizes.shape[0]
    ):
        got = "None" if mask is None else f"{mask.dtype} {tuple(mask.shape)}"
        raise TypeError(
            f"proportional attention needs an additive float mask [B, 1, Q, {sizes.shape[1]}] from "
            f"the {family!r} adapter's prefill_mask / decode_mask with impl='eager', got {got}; "
            "fix the adapter's masks or set proportional_attention: false"
        )
    # log in float32 first: the mask's dtype (bf16) would round the sizes before the log
    bias = sizes.clamp_min(1).to(torch.float32).log().to(mask.dtype)
    return mask + bias[:, None, None, :].to(mask.device)


class ProportionalAttention:
    """The proportional-attention part of one session (a no-op when disabled).

    Args:
        adapter: the session's family adapter (its masks get the bias).
        enabled: `lightkv.Pipeline.proportional_attention`.

    Raises:
        NotImplementedError: enabled on a family that declares it cannot add a bias to its
            attention logits (`Adapter.proportional_attention_refused`).
    """

    def __init__(self, adapter: Adapter, enabled: bool):
        self.adapter = adapter
        self.enabled = bool(enabled)
        reason = type(adapter).proportional_attention_refused
        if self.enabled and reason:
            raise NotImplementedError(
                f"proportional attention is not supported for the {adapter.family!r} family: "
                f"{reason}; set proportional_attention: false "
                "(Pipeline(proportional_attention=False))"
            )
        self._of: Provenance | None = None
        self._sizes: torch.Tensor | None = None

    def sizes(self, provenance: Provenance | None) -> torch.Tensor | None:
        """Original tokens per current token, computed once per stage (the provenance
        changes only when a stage runs).

        Args:
            provenance: the provenance of the stages so far (None: no stage yet).

        Returns:
            ``[B, N]`` long, or None when disabled or while no token stands for more than
            one (then nothing changes, bit for bit).
        """
        if not self.enabled or provenance is None:
            return None
        if provenance is not self._of:
            sizes = provenance.sizes()
            self._of = provenance
            self._sizes = sizes if bool((sizes > 1).any()) else None  # one host sync per stage
        return self._sizes

    def prefill_mask(
        self,
        layer: int,
        layout: VisionLayout,
        provenance: Provenance | None,
        impl: str,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """The family's prefill mask of a compressed layer, with ``log(size)`` per key
        column when a token stands for several.

        Args:
            layer: the decoder layer.
            layout: the current (compressed) sequence.
            provenance: the provenance of the stages so far.
            impl: ``"sdpa"`` or ``"eager"``.
            dtype: the mask's dtype (the hidden states').

        Returns:
            ``[B, 1, N, N]`` (or None / bool as the family gives it when nothing is biased).
        """
        sizes = self.sizes(provenance)
        if sizes is None:
            return self.adapter.prefill_mask(layer, layout.origin, layout.valid_mask, impl, dtype)
        mask = self.adapter.prefill_mask(layer, layout.origin, layout.valid_mask, "eager", dtype)
        return add_log_sizes(mask, sizes, self.adapter.family)

    def decode_mask(
        self,
        layer: int,
        origin: torch.Tensor | None,
        valid: torch.Tensor,
        q_len: int,
        impl: str,
        dtype: torch.dtype,
        cache: MaskedCacheLayer,
    ) -> torch.Tensor | None:
        """The family's decode mask over a compressed layer's cache, with ``log(size)`` of
        the cached entries (new tokens stand for themselves).

        Args:
            layer: the decoder layer.
            origin: ``[B, L]`` original columns, cache then new tokens.
            valid: ``[B, L]`` validity, cache then new tokens.
            q_len: new tokens.
            impl: ``"sdpa"`` or ``"eager"``.
            dtype: the mask's dtype.
            cache: the layer's cache (its ``sizes``: None when nothing is biased).

        Returns:
            ``[B, 1, q_len, L]`` (or what the family gives when nothing is biased).
        """
        if not self.enabled or cache.sizes is None:
            return self.adapter.decode_mask(layer, origin, valid, q_len, impl, dtype)
        mask = self.adapter.decode_mask(layer, origin, valid, q_len, "eager", dtype)
        new = torch.ones(
            cache.sizes.shape[0], q_len, dtype=cache.sizes.dtype, device=cache.sizes.device
        )
        return add_log_sizes(mask, torch.cat([cache.sizes, new], dim=1), self.adapter.family)

    def cache_sizes(self, sizes: torch.Tensor) -> torch.Tensor | None:
        """What a cache layer keeps of its entries' sizes (the cache mode).

        Args:
            sizes: ``[B, L]`` original tokens per entry (a cache stage's `StageResult.sizes`).

        Returns:
            ``sizes``, or None when disabled or when every entry stands for one.
        """
        if not self.enabled or not bool((sizes > 1).any()):
            return None
        return sizes
