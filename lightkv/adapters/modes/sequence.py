"""The ``sequence`` mode, always on: every layer receives inputs that describe the sequence
as it is now, whatever shortened it.

In a prefill it records each layer's token counts and, after a hidden-state stage, hands
every later layer the shorter sequence's mask (4-D; under FlashAttention-2 the 2-D padding mask
of its compacted rows) (`Adapter.prefill_mask`, plus
``log(size)`` with proportional attention on its mask route; on the channel and flex
routes the layer's attention call is routed instead), its position embeddings and ids (gathered at
the survivors' original positions; a layer with its own RoPE, Gemma 3's local and global,
gets its own gathered) and a `MaskedCacheLayer` that remembers the holes. In a decoding
step each layer whose cache has holes gets a mask built from that cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...graph.layout import TokenKind
from ..cache import MaskedCacheLayer, install_masked_layer
from ..masks import FLASH, gather_tokens
from ..trace import LayerStat
from .base import LayerCall, Mode, SessionContext

__all__ = ["SequenceMode"]


@Mode.register("sequence")
@dataclass
class SequenceMode(Mode):
    """Masks, positions, cache holes and per-layer counts for every layer."""

    own = False  # runs whenever the session needs it

    order = 10
    layers = None  # every layer

    @classmethod
    def wanted(cls, ctx: SessionContext) -> bool:
        return True

    def prefill_pre(self, call: LayerCall) -> None:
        st, i, hidden, kwargs = call.state, call.layer, call.hidden, call.kwargs
        trace = st.trace
        assert trace is not None and st.new_valid is not None  # a prefill's state has both
        if trace.kv_dtype is None:
            trace.kv_dtype = hidden.dtype
        layout = st.layout
        if layout is None:
            zeros = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
            trace.layers.append(LayerStat(i, hidden.shape[1], st.new_valid.sum(1), zeros, zeros))
            return
        call.check_layout()
        kind = layout.kind
        trace.layers.append(
            LayerStat(
                i,
                layout.seq_len,
                layout.valid_mask.sum(1),
                (kind == TokenKind.VISION).sum(1),
                (kind == TokenKind.STRUCTURAL).sum(1),
            )
        )
        ctx = self.ctx
        # the released code's merge layers run eager attention: this call only, with an eager mask
        eager = ctx.released.eager(i)
        impl = "eager" if eager else st.impl
        if eager:
            ctx.released.arm(i)
        if not st.compressed:
            st.full_pos, st.full_pos_ids = (
                kwargs.get("position_embeddings"),
                kwargs.get("position_ids"),
            )
            if ctx.released.noncausal(i):  # the released code's first merge layer: no causal mask
                kwargs["attention_mask"] = ctx.released.prefill_mask(i, layout, impl, hidden.dtype)
                if impl == FLASH:  # no mask can lift FlashAttention's causality: its flag can
                    kwargs["is_causal"] = False
            elif eager:  # the model's own mask is made for its implementation (None under sdpa)
                kwargs["attention_mask"] = ctx.released.eager_mask(i, layout, hidden.dtype)
            return
        key = ctx.adapter.mask_key(i)
        if eager:
            key = (key, "eager")
        if key not in st.masks:
            st.masks[key] = ctx.proportional.prefill_mask(
                i, layout, st.provenance, impl, hidden.dtype
            )
        kwargs["attention_mask"] = st.masks[key]
        # the channel and flex routes carry log(size) through this call's kernel, not the mask
        channel = ctx.proportional.arm_prefill(i, st.provenance, impl, hidden.dtype)
        full = kwargs.get("position_embeddings")
        if full is not None and full is not st.full_pos and isinstance(full, tuple):
            # this layer has its own position embeddings (Gemma 3: local and global RoPE)
            if id(full) not in st.gathered:
                index = layout.origin.clamp_min(0)
                st.gathered[id(full)] = (full, tuple(gather_tokens(t, index) for t in full))
            kwargs["position_embeddings"] = st.gathered[id(full)][1]
        elif st.pos is not None:
            kwargs["position_embeddings"] = st.pos
        if kwargs.get("position_ids") is not None:
            kwargs["position_ids"] = st.pos_ids
        cache = call.cache
        if cache is not None:
            masked = install_masked_layer(cache, i, ctx.token, ctx.adapter.cache_layer_types)
            masked.pending, masked.pending_origin = layout.valid_mask, layout.origin
            assert st.provenance is not None  # set by the stage that compressed the sequence
            masked.pending_columns = st.provenance.owner.shape[1]  # the original prompt width
            masked.pending_sizes = ctx.proportional.sizes(
                st.provenance
            )  # None unless proportional attention
            masked.pending_channel = channel  # None unless its channel route

    def install(self) -> list:
        # the eager merge layers' switches and the bias routes' (none unless asked for)
        return self.ctx.released.install() + self.ctx.proportional.install()

    def end_forward(self) -> None:
        self.ctx.released.disarm()
        self.ctx.proportional.end_forward()

    def decode_pre(self, call: LayerCall) -> None:
        st, i, cache = call.state, call.layer, call.cache
        if (
            cache is None
            or len(cache.layers) <= i
            or not isinstance(cache.layers[i], MaskedCacheLayer)
        ):
            return
        layer_cache = cache.layers[i]
        if layer_cache.valid is None:
            return
        dev = layer_cache.valid.device
        q = call.hidden.shape[1]
        assert st.new_valid is not None  # every forward's state has it (the session)
        valid = torch.cat([layer_cache.valid, st.new_valid.to(dev)], dim=1)
        new_origin = (st.past + torch.arange(q, device=dev)).expand(valid.shape[0], q)
        origin = (
            torch.cat([layer_cache.origin, new_origin], dim=1)
            if layer_cache.origin is not None
            else None
        )
        call.kwargs["attention_mask"] = self.ctx.proportional.decode_mask(
            i, origin, valid, q, st.impl, call.hidden.dtype, layer_cache
        )
        layer_cache.pending = st.new_valid
        layer_cache.pending_origin = new_origin
