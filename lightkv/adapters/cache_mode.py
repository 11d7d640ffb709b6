"""The cache mode inside a session: cache stages after a layer's prefill (ElasticCache-style
merging, `lightkv.cache_stage.CacheStage`) and H2O's heavy-hitter eviction after the prefill
and after every decoding step (`lightkv.policies.H2OSchedule`).

Internals of `lightkv.adapters.session`. Hidden states are never touched: the prefill runs
as without a session, and each listed layer's cache becomes a `MaskedCacheLayer` whose
entries (with ``valid`` holes and ``origin`` columns) are replaced after the layer has run.
Decoding then reads each compressed layer through a mask built from its own ``valid``, as
for hidden-state stages.

Importance comes from the layer's own projections (`AttentionProbe`): the causal attention
each entry receives, accumulated over the prompt's queries (and, for H2O, every decoded
token's queries against the kept entries), never from the model's attention weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..cache_stage import CacheStage
from ..graph.layout import TokenKind
from ..graph.scatter import right_align
from ..pipeline import Stage
from ..policies.cache_policies import accumulated_attention, h2o_keep
from ..policies.relevance import _match_heads
from ..policies.schedulers.cache import H2OSchedule
from . import features
from .cache import MaskedCacheLayer, install_masked_layer
from .masks import _batch, drop_padding
from .probes import AttentionProbe
from .trace import LayerStat, StageRecord

__all__ = ["CacheMode"]


def _scale(probe: AttentionProbe) -> float:
    scale = getattr(probe.attn, "scaling", None)
    return float(scale) if scale is not None else 1.0 / math.sqrt(probe.head_dim)


class CacheMode:
    """The cache-mode part of one session.

    Attributes:
        stages: cache stages by layer.
        h2o: the H2O schedule (None: no eviction).
        evict: layers that evict.
    """

    def __init__(self, session, stages: list[Stage]):
        self.session = session
        self.stages = {s.spec.layer: s for s in stages if s.spec.cache}
        sched = session.pipeline.scheduler
        self.h2o: H2OSchedule | None = sched if isinstance(sched, H2OSchedule) else None
        self.evict = set(self.h2o.evict_layers(session.num_layers)) if self.h2o is not None else set()
        self.layers = set(self.stages) | self.evict
        self.text_too = self.h2o is not None and self.h2o.tokens == "all" and bool(self.evict)
        """H2O over every token also evicts in a prompt without vision tokens."""
        self._pending: dict[int, torch.Tensor] = {}
        if self.layers:
            session.adapter.check_cache_layers(sorted(self.layers))

    # ---------------------------------------------------------------- prefill
    def prefill_pre(self, i: int, st, hidden: torch.Tensor, kwargs: dict[str, Any], cache) -> None:
        """Before layer ``i``'s prefill: a `MaskedCacheLayer` to receive its entries, and
        the importance of its tokens from the layer's own projections."""
        layout = st.layout
        if i not in self.layers or layout is None or cache is None:
            return
        s = self.session
        if not st.compressed:  # the cache mode never runs with hidden-state stages
            masked = install_masked_layer(cache, i, s._token, s.adapter.cache_layer_types)
            masked.pending, masked.pending_origin = layout.valid_mask, layout.origin
            masked.pending_columns = layout.seq_len
        pos = kwargs.get("position_embeddings")
        probe = s._probes[i]
        with torch.no_grad():
            if i in self.stages:
                xi, flops = features.relevance(probe, self.stages[i], hidden, pos, layout, i)
            else:
                if pos is None:
                    raise RuntimeError(f"layer {i} received no position_embeddings; cannot score its cache for H2O")
                cos, sin = _batch(pos[0], hidden.shape[0]), _batch(pos[1], hidden.shape[0])
                x = probe.normed(hidden)
                q, k = probe.queries(x, cos, sin), probe.keys(x, cos, sin)
                xi = accumulated_attention(q, k, layout.valid_mask, layout.origin, _scale(probe))
                b, n = layout.batch_size, layout.seq_len
                flops = 2.0 * b * n * probe.hidden * (probe.heads + probe.kv_heads) * probe.head_dim
                flops += 2.0 * b * probe.heads * probe.head_dim * n * n
        st.trace.relevance_flops += flops
        self._pending[i] = xi

    def prefill_post(self, i: int, st, kwargs: dict[str, Any], cache) -> None:
        """After layer ``i``'s prefill: compress (cache stage) or evict (H2O) its cache; with
        proportional attention a merged entry keeps its size for the decoding masks."""
        if i not in self._pending or cache is None:
            return
        layer = cache.layers[i]
        layout = st.layout
        xi = self._pending.pop(i)
        s = self.session
        if i in self.stages:
            stage = self.stages[i]
            with torch.no_grad():
                res = CacheStage(stage)(layer.keys, layer.values, layout, xi, None, finish=drop_padding)
            layer.replace(res.keys, res.values, res.valid, res.origin, s._prop.cache_sizes(res.result.sizes))
            st.trace.stages.append(StageRecord(layer=i, stage=stage, result=res.result))
            kind = res.result.layout.kind
        else:
            h2o = self.h2o
            valid = layer.valid
            candidate = valid & (layout.kind == TokenKind.VISION) if h2o.tokens == "vision" else valid.clone()
            heavy, recent = h2o.counts(candidate.sum(1))
            layer.extra.update(scores=xi.double(), candidate=candidate, heavy=heavy, recent=recent,
                               kind=layout.kind.clone())
            self._evict(layer)
            kind = layer.extra["kind"]
        stat = st.trace.layers[-1]
        st.trace.uncompressed[stat.layer] = stat
        valid = layer.valid
        st.trace.layers[-1] = LayerStat(
            stat.layer, int(valid.shape[1]), valid.sum(1),
            ((kind == TokenKind.VISION) & valid).sum(1), ((kind == TokenKind.STRUCTURAL) & valid).sum(1),
        )

    # ---------------------------------------------------------------- decoding (H2O)
    def decode_pre(self, i: int, st, hidden: torch.Tensor, kwargs: dict[str, Any], layer: MaskedCacheLayer) -> None:
        """Before a decoding step of an evicting layer: add the new tokens' attention over
        the kept entries (and themselves) to the accumulated scores."""
        if i not in self.evict or "scores" not in layer.extra or self.h2o.tokens == "vision":
            return  # vision-only: decoding adds no candidates, nothing more is ever evicted
        pos = kwargs.get("position_embeddings")
        if pos is None:
            raise RuntimeError(f"layer {i} received no position_embeddings; cannot score its cache for H2O")
        probe = self.session._probes[i]
        b, q = hidden.shape[:2]
        with torch.no_grad():
            cos, sin = _batch(pos[0], b), _batch(pos[1], b)
            x = probe.normed(hidden)
            qn, kn = probe.queries(x, cos, sin), probe.keys(x, cos, sin)
            acc = torch.promote_types(qn.dtype, torch.float32)
            keys = _match_heads(torch.cat([layer.keys.to(acc), kn.to(acc)], dim=2), probe.heads)
            new_valid = st.new_valid.to(layer.valid.device)
            valid = torch.cat([layer.valid, new_valid], dim=1)
            past, total = layer.valid.shape[1], valid.shape[1]
            col = torch.arange(total, device=valid.device)
            me = past + torch.arange(q, device=valid.device)
            allowed = valid.unsqueeze(1) & (col.unsqueeze(0) <= me.unsqueeze(1)).unsqueeze(0)
            allowed |= (col.unsqueeze(0) == me.unsqueeze(1)).unsqueeze(0)
            logits = torch.matmul(qn.to(acc), keys.transpose(-1, -2)) * _scale(probe)  # [B, H, q, L + q]
            attn = torch.softmax(logits.masked_fill(~allowed.unsqueeze(1), float("-inf")), dim=-1)
            add = (attn * new_valid[:, None, :, None]).sum(dim=(1, 2)).double()
        ex = layer.extra
        ex["scores"] = torch.cat([ex["scores"], ex["scores"].new_zeros(b, q)], dim=1) + add
        ex["candidate"] = torch.cat([ex["candidate"], new_valid], dim=1)
        ex["kind"] = torch.cat([ex["kind"], torch.full_like(new_valid, int(TokenKind.TEXT), dtype=ex["kind"].dtype)], 1)

    def decode_post(self, i: int, layer) -> None:
        """After a decoding step of an evicting layer: evict to the budget."""
        if i in self.evict and isinstance(layer, MaskedCacheLayer) and "scores" in layer.extra \
                and self.h2o.tokens != "vision":
            self._evict(layer)

    # ---------------------------------------------------------------- eviction
    @staticmethod
    def _evict(layer: MaskedCacheLayer) -> None:
        ex = layer.extra
        valid = layer.valid
        keep = h2o_keep(ex["scores"], ex["candidate"] & valid, layer.origin, ex["heavy"], ex["recent"]) & valid
        if bool((keep == valid).all()):
            return
        index, _ = right_align(keep)
        hole = index < 0
        idx = index.clamp_min(0)

        def entries(t: torch.Tensor, fill) -> torch.Tensor:
            return t.gather(1, idx).masked_fill(hole, fill)

        def cache(t: torch.Tensor) -> torch.Tensor:
            g = t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))
            return g.masked_fill(hole[:, None, :, None], 0)

        sizes = None if layer.sizes is None else entries(layer.sizes, 1)
        layer.replace(cache(layer.keys), cache(layer.values), entries(valid, False), entries(layer.origin, -1), sizes)
        ex["scores"] = entries(ex["scores"], 0.0)
        ex["candidate"] = entries(ex["candidate"], False)
        ex["kind"] = entries(ex["kind"], int(TokenKind.PAD))
