"""Proportional attention (ToMe, Bolya et al., ICLR 2023) inside a session: every layer
after a merge adds ``log(size)`` of each key column to its attention logits, so a token
that stands for ``k`` original tokens gets the attention weight of ``k`` copies of itself
(softmax over ``k`` equal keys = one key with logit ``+ log k``).

Internals of `lightkv.adapters.session` (`lightkv.Pipeline.proportional_attention`). The
bias takes one of three exact routes (`lightkv.adapters.bias`), chosen by the session's
``proportional_route`` (``auto``: by the model's attention implementation):

* ``mask`` (``eager``, ``sdpa``): on the additive (float) 4-D mask the session already
  hands every compressed layer: the family's own mask (`Adapter.prefill_mask`,
  `Adapter.decode_mask`, asked for its ``eager`` form) plus ``log(size)`` per key column.
* ``channel`` (FlashAttention-2; any kernel): the family's own mask, and one extra head
  channel carrying the bias (``Q' = [Q, 1]``, ``K' = [K, log(s) / scale]``, ``V' = [V, 0]``);
  the layer's cache holds ``K'`` and ``V'``.
* ``flex`` (``flex_attention``; any kernel): FlexAttention with a ``score_mod``.

Sizes come from the provenance of the stages so far (prefill) and from the layer's
`MaskedCacheLayer.sizes` (decoding). While no token stands for more than one, nothing is
changed on any route: the masks, kernels and caches are exactly those without the option.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..graph.layout import VisionLayout
from ..graph.provenance import Provenance
from .base import Adapter
from .bias import FLEX, BiasDispatch, choose_route, log_sizes
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
    bias = log_sizes(sizes, mask.dtype)
    return mask + bias[:, None, None, :].to(mask.device)


class ProportionalAttention:
    """The proportional-attention part of one session: a no-op when disabled, except under
    flex_attention, where it routes every compressed layer's call to lightkv's FlexAttention
    (a ``BlockMask`` of lightkv's mask, with or without the bias).

    Args:
        adapter: the session's family adapter (its masks get the bias).
        enabled: `lightkv.Pipeline.proportional_attention`.
        route: ``auto``, ``mask``, ``channel`` or ``flex`` (`lightkv.adapters.bias.ROUTES`).
        attention: each decoder layer's self-attention module (the ``channel`` and ``flex``
            routes reach their kernels through them).
        impl: the decoder's attention implementation when the session starts.

    Raises:
        NotImplementedError: enabled on a family that declares it cannot add a bias to its
            attention logits (`Adapter.proportional_attention_refused`).
        ValueError: an unknown route, or one ``impl`` cannot take (`choose_route`).
    """

    def __init__(
        self,
        adapter: Adapter,
        enabled: bool,
        route: str = "auto",
        attention: Sequence[nn.Module | None] = (),
        impl: str = "sdpa",
    ):
        self.adapter = adapter
        self.enabled = bool(enabled)
        reason = type(adapter).proportional_attention_refused
        if self.enabled and reason:
            raise NotImplementedError(
                f"proportional attention is not supported for the {adapter.family!r} family: "
                f"{reason}; set proportional_attention: false "
                "(Pipeline(proportional_attention=False))"
            )
        # a route the kernel cannot take fails here, not at a forward (any name, when unused)
        choose_route(route, impl if self.enabled else "sdpa")
        self.requested = route
        self.dispatch = BiasDispatch(attention)
        # under flex_attention every compressed layer runs lightkv's FlexAttention call
        self.routed = self.enabled or impl == FLEX
        self._of: Provenance | None = None
        self._sizes: torch.Tensor | None = None

    def route(self, impl: str) -> str:
        """The route under attention implementation ``impl`` (`choose_route`; without the
        option, ``flex`` under flex_attention and ``mask`` elsewhere, which adds nothing)."""
        if not self.enabled:
            return "flex" if impl == FLEX else "mask"
        return choose_route(self.requested, impl)

    def install(self) -> list:
        """The dispatch hooks (none while disabled, unless under flex_attention)."""
        return self.dispatch.install() if self.routed else []

    def _flex(self, route: str, impl: str, biased: bool) -> bool:
        """Whether a compressed layer's call runs lightkv's FlexAttention: biased on the flex
        route, or any compressed layer under flex_attention (transformers' own call would
        need a mask of the uncompressed prompt).

        Raises:
            RuntimeError: the model was switched to flex_attention after the session started.
        """
        if route != "flex" or not (biased or impl == FLEX):
            return False
        if not self.routed:
            raise RuntimeError(
                "the model was switched to flex_attention after this lightkv session started; "
                "start the session after switching"
            )
        return True

    def end_forward(self) -> None:
        self.dispatch.disarm()

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
        column when a token stands for several and the route is the mask.

        Args:
            layer: the decoder layer.
            layout: the current (compressed) sequence.
            provenance: the provenance of the stages so far.
            impl: ``"sdpa"``, ``"eager"``, ``"flash_attention_2"`` or ``"flex_attention"``.
            dtype: the mask's dtype (the hidden states').

        Returns:
            ``[B, 1, N, N]`` (or None / bool / 2-D as the family gives it for ``impl`` when
            nothing is biased on the mask).
        """
        sizes = self.sizes(provenance)
        route = self.route(impl)
        if sizes is None or route != "mask":
            # FlexAttention's BlockMask is built from the 4-D bool form (None: causal)
            impl = "sdpa" if self._flex(route, impl, sizes is not None) else impl
            return self.adapter.prefill_mask(layer, layout.origin, layout.valid_mask, impl, dtype)
        mask = self.adapter.prefill_mask(layer, layout.origin, layout.valid_mask, "eager", dtype)
        return add_log_sizes(mask, sizes, self.adapter.family)

    def arm_prefill(
        self, layer: int, provenance: Provenance | None, impl: str, dtype: torch.dtype
    ) -> float | None:
        """Route compressed layer ``layer``'s coming prefill call: ``channel`` / ``flex``
        while a token stands for several; under flex_attention every call (`_flex`).

        Returns:
            What the layer's cache multiplies its bias column by (`MaskedCacheLayer.channel`:
            ``1 / scale``) on the channel route; None otherwise.
        """
        sizes = self.sizes(provenance)
        route = self.route(impl)
        logs = None if sizes is None else log_sizes(sizes, dtype)
        if self._flex(route, impl, sizes is not None):
            self.dispatch.arm(layer, route, logs)
        elif route == "channel" and sizes is not None:
            self.dispatch.arm(layer, route, logs)
            return self.dispatch.channel(layer)
        return None

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
        the cached entries (new tokens stand for themselves) on the mask route; on the other
        routes the family's own mask, and the layer's call routed.

        Args:
            layer: the decoder layer.
            origin: ``[B, L]`` original columns, cache then new tokens.
            valid: ``[B, L]`` validity, cache then new tokens.
            q_len: new tokens.
            impl: the attention implementation.
            dtype: the mask's dtype.
            cache: the layer's cache (its ``sizes``: None when nothing is biased).

        Returns:
            ``[B, 1, q_len, L]`` (or what the family gives when nothing is biased).

        Raises:
            RuntimeError: the channel route over a cache filled without the bias channel.
        """
        route = self.route(impl)
        biased = self.enabled and cache.sizes is not None
        if not biased:
            if self._flex(route, impl, False):
                self.dispatch.arm(layer, route)
                impl = "sdpa"
            return self.adapter.decode_mask(layer, origin, valid, q_len, impl, dtype)
        held = cache.sizes
        assert held is not None  # biased implies sizes
        new = torch.ones(held.shape[0], q_len, dtype=held.dtype, device=held.device)
        sizes = torch.cat([held, new], dim=1)
        if route == "mask":
            mask = self.adapter.decode_mask(layer, origin, valid, q_len, "eager", dtype)
            return add_log_sizes(mask, sizes, self.adapter.family)
        if route == "channel":
            if cache.channel is None:
                raise RuntimeError(
                    f"decoder layer {layer}'s cache holds merged entries without the bias channel "
                    "(filled under another attention implementation); decode under the one the "
                    "prefill ran with"
                )
            self.dispatch.arm(layer, route)  # the cache holds K' and V'
        elif self._flex(route, impl, True):
            self.dispatch.arm(layer, route, log_sizes(sizes, dtype))
            impl = "sdpa"
        return self.adapter.decode_mask(layer, origin, valid, q_len, impl, dtype)

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

    def channel(self, layer: int, impl: str) -> float | None:
        """``1 / scale`` of ``layer`` on the channel route (what a cache layer's bias
        column is multiplied by), None on the others."""
        if not self.enabled or self.route(impl) != "channel":
            return None
        return self.dispatch.channel(layer)
