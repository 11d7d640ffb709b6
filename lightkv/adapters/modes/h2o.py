"""The ``h2o`` mode: heavy-hitter eviction of listed layers' caches after the prefill and
after every decoding step (`lightkv.policies.H2OSchedule`, which names this mode and holds
its parameters).

A token's score is the causal attention it receives, accumulated over the prompt's queries
and then every decoded token's queries against the kept entries, computed from the layer's
own projections: at the prefill read as the layer computes them (`CacheEntriesMode`'s
tap), while decoding projected again for the few new tokens. Evicted entries never come
back.
"""

from __future__ import annotations

import math

import torch

from ...graph.layout import TokenKind
from ...graph.scatter import right_align
from ...policies.cache_policies import accumulated_attention, accumulated_attention_flops, h2o_keep
from ...policies.relevance import _match_heads
from ..cache import MaskedCacheLayer
from ..masks import _batch
from ..probes import AttentionProbe
from .base import LayerCall, Mode, SessionContext
from .cache import CacheEntriesMode

__all__ = ["H2OMode", "evict"]


def _scale(probe: AttentionProbe) -> float:
    scale = getattr(probe.attn, "scaling", None)
    return float(scale) if scale is not None else 1.0 / math.sqrt(probe.head_dim)


def _queries_keys(
    probe: AttentionProbe, call: LayerCall, raw: dict[str, torch.Tensor] | None = None
):
    """Post-RoPE queries and keys of the layer's tokens: from its raw projection outputs
    when given, else from its input projected again."""
    pos = call.kwargs.get("position_embeddings")
    if pos is None:
        raise RuntimeError(
            f"layer {call.layer} received no position_embeddings; cannot score its cache for H2O"
        )
    hidden = call.hidden
    cos, sin = _batch(pos[0], hidden.shape[0]), _batch(pos[1], hidden.shape[0])
    if raw is not None:
        return probe.queries_from(raw, cos, sin), probe.keys_from(raw, cos, sin)
    x = probe.normed(hidden)
    return probe.queries(x, cos, sin), probe.keys(x, cos, sin)


@Mode.register("h2o")
class H2OMode(CacheEntriesMode):
    """Eviction on the layers of the schedule's `H2OSchedule.evict_layers`.

    Attributes:
        h2o: the schedule (``budget``, ``recent_share``, ``tokens``, `counts`).
    """

    def __init__(self, ctx: SessionContext) -> None:
        self.h2o = ctx.pipeline.scheduler
        super().__init__(ctx, self.h2o.evict_layers(ctx.num_layers))
        self.every_token = self.h2o.tokens == "all"
        self.text_too = self.every_token and bool(self.layers)
        """H2O over every token also evicts in a prompt without vision tokens."""

    def reads_projections(self, layer):
        return True

    def importance(self, call, raw=None):
        probe, layout = self.ctx.probes[call.layer], call.state.layout
        q, k = _queries_keys(probe, call, raw)
        xi = accumulated_attention(q, k, layout.valid_mask, layout.origin, _scale(probe))
        b, n = layout.batch_size, layout.seq_len
        flops = (
            0.0
            if raw is not None
            else 2.0 * b * n * probe.hidden * (probe.heads + probe.kv_heads) * probe.head_dim
        )
        return xi, flops + accumulated_attention_flops(
            layout.valid_mask, layout.origin, probe.heads, probe.head_dim
        )

    def rewrite(self, call, layer, importance):
        layout = call.state.layout
        valid = layer.valid
        candidate = valid.clone() if self.every_token else valid & (layout.kind == TokenKind.VISION)
        heavy, recent = self.h2o.counts(candidate.sum(1))
        layer.extra.update(
            scores=importance.double(),
            candidate=candidate,
            heavy=heavy,
            recent=recent,
            kind=layout.kind.clone(),
        )
        self._evict(layer)
        return layer.extra["kind"]

    def _decoding(self, call: LayerCall) -> MaskedCacheLayer | None:
        # vision-only: decoding adds no candidates, so nothing more is ever evicted
        cache = call.cache
        if not self.every_token or cache is None or len(cache.layers) <= call.layer:
            return None
        layer = cache.layers[call.layer]
        return layer if isinstance(layer, MaskedCacheLayer) and "scores" in layer.extra else None

    def decode_pre(self, call: LayerCall) -> None:
        """Add the new tokens' attention over the kept entries (and themselves) to the scores."""
        layer = self._decoding(call)
        if layer is None:
            return
        probe = self.ctx.probes[call.layer]
        b, q = call.hidden.shape[:2]
        with torch.no_grad():
            qn, kn = _queries_keys(probe, call)
            acc = torch.promote_types(qn.dtype, torch.float32)
            keys = _match_heads(torch.cat([layer.keys.to(acc), kn.to(acc)], dim=2), probe.heads)
            new_valid = call.state.new_valid.to(layer.valid.device)
            valid = torch.cat([layer.valid, new_valid], dim=1)
            past, total = layer.valid.shape[1], valid.shape[1]
            col = torch.arange(total, device=valid.device)
            me = past + torch.arange(q, device=valid.device)
            allowed = valid.unsqueeze(1) & (col.unsqueeze(0) <= me.unsqueeze(1)).unsqueeze(0)
            allowed |= (col.unsqueeze(0) == me.unsqueeze(1)).unsqueeze(0)
            logits = torch.matmul(qn.to(acc), keys.transpose(-1, -2)) * _scale(
                probe
            )  # [B, H, q, L + q]
            attn = torch.softmax(logits.masked_fill(~allowed.unsqueeze(1), float("-inf")), dim=-1)
            add = (attn * new_valid[:, None, :, None]).sum(dim=(1, 2)).double()
        ex = layer.extra
        ex["scores"] = torch.cat([ex["scores"], ex["scores"].new_zeros(b, q)], dim=1) + add
        ex["candidate"] = torch.cat([ex["candidate"], new_valid], dim=1)
        ex["kind"] = torch.cat(
            [ex["kind"], torch.full_like(new_valid, int(TokenKind.TEXT), dtype=ex["kind"].dtype)], 1
        )

    def decode_post(self, call: LayerCall) -> None:
        """Evict to the budget."""
        layer = self._decoding(call)
        if layer is not None:
            self._evict(layer)

    @staticmethod
    def _evict(layer: MaskedCacheLayer) -> None:
        ex = layer.extra
        valid = layer.valid
        keep = (
            h2o_keep(ex["scores"], ex["candidate"] & valid, layer.origin, ex["heavy"], ex["recent"])
            & valid
        )
        moved = evict(layer, keep)
        if moved is not None:
            ex["scores"], ex["candidate"] = moved(ex["scores"], 0.0), moved(ex["candidate"], False)
            ex["kind"] = moved(ex["kind"], int(TokenKind.PAD))


def evict(layer: MaskedCacheLayer, keep: torch.Tensor):
    """Keep only the entries where ``keep`` (``[B, L]`` bool, within ``layer.valid``) holds,
    right-aligned, holes on the left (what every compressed cache looks like).

    Returns:
        None when nothing was evicted; otherwise a function ``moved(t, fill)`` that moves
        any other per-entry tensor ``[B, L]`` the same way (``fill`` in the new holes).
    """
    valid = layer.valid
    if bool((keep == valid).all()):
        return None
    index, _ = right_align(keep)
    hole = index < 0
    idx = index.clamp_min(0)

    def moved(t: torch.Tensor, fill) -> torch.Tensor:
        return t.gather(1, idx).masked_fill(hole, fill)

    def cache(t: torch.Tensor) -> torch.Tensor:
        g = t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))
        return g.masked_fill(hole[:, None, :, None], 0)

    sizes = None if layer.sizes is None else moved(layer.sizes, 1)
    layer.replace(
        cache(layer.keys), cache(layer.values), moved(valid, False), moved(layer.origin, -1), sizes
    )
    return moved
