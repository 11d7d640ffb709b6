"""The ``cache`` mode: a stage on a layer's cached keys and values right after the layer's
prefill (ElasticCache-style merging, `lightkv.cache_stage.CacheStage`;
`lightkv.policies.CacheSchedule`), and `CacheEntriesMode`, what it shares with ``h2o``.

Hidden states are never touched: the prefill runs as without a session, and each listed
layer's cache becomes a `MaskedCacheLayer` whose entries (with ``valid`` holes and
``origin`` columns) are replaced after the layer has run. Decoding then reads each such
layer through a mask built from its own ``valid`` (`lightkv.adapters.modes.sequence`).
Importance comes from the layer's own projections, never from the model's attention
weights: a `ProjectionTap` reads the query and key projections as the layer computes them
and scores its entries right then (one chunked causal ``QK^T``, no second projection);
where the projections did not run as the tap expected, or with
``reuse_projections=False``, the layer's input is projected once more after it ran (the
same scores, bit for bit, at the cost of a second projection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache_stage import CacheStage
from ...graph.layout import TokenKind
from ...stage import placement_problem
from ..cache import MaskedCacheLayer, install_masked_layer
from ..masks import drop_padding
from ..tap import ProjectionTap, TapResult
from ..trace import LayerStat, StageRecord
from .base import LayerCall, Mode

__all__ = ["CacheEntriesMode", "CacheMode"]


class CacheEntriesMode(Mode):
    """Base of modes that rewrite a layer's cache entries after its prefill: before the
    layer, a `MaskedCacheLayer` to receive them and a `ProjectionTap` armed to score the
    tokens' importance from the layer's own projections (`importance` with ``raw``); after
    it, `rewrite` and the layer's counts updated (the trace keeps the old ones in
    ``uncompressed``). Subclasses call `start_cache` from `start` with the layers.

    Attributes:
        taps: the projection taps by layer (empty with ``reuse_projections=False``).
    """

    order = 30

    def start_cache(self, layers) -> None:
        """Rewrite the caches of ``layers`` (call from `start`)."""
        ctx = self.ctx
        self.layers = self.cache_layers = frozenset(layers)
        self._pending: dict[int, torch.Tensor | None] = {}
        if self.layers:
            ctx.adapter.check_cache_layers(sorted(self.layers))
        self.taps = {
            i: ProjectionTap(ctx.probes[i], i)
            for i in sorted(self.layers)
            if ctx.reuse_projections and self.reads_projections(i)
        }

    def reads_projections(self, layer: int) -> bool:
        """Whether the importance at ``layer`` reads the layer's queries or keys: then a tap
        reads them as the layer runs and `importance` gets them as ``raw``. Default: no
        (`importance` is called with the call alone, before the layer runs)."""
        return False

    def install(self) -> list:
        return [h for tap in self.taps.values() for h in tap.install()]

    def importance(
        self, call: LayerCall, raw: dict[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, float]:
        """``([B, N] importance of the layer's tokens, FLOPs)``: from the layer's raw
        projection outputs when ``raw`` is given (read by the tap as the layer ran, where
        `reads_projections`; no projection FLOPs), else from the layer's input
        ``call.hidden``. A subclass that never reads projections may take ``call`` alone."""
        raise NotImplementedError

    def rewrite(
        self, call: LayerCall, layer: MaskedCacheLayer, importance: torch.Tensor
    ) -> torch.Tensor:
        """Replace ``layer``'s entries after the prefill; returns the entries' token kinds."""
        raise NotImplementedError

    def prefill_pre(self, call: LayerCall) -> None:
        st, i, cache = call.state, call.layer, call.cache
        layout = st.layout
        if layout is None or cache is None:
            return
        if not st.compressed:  # after a hidden-state stage `sequence` has installed it already
            masked = install_masked_layer(
                cache, i, self.ctx.token, self.ctx.adapter.cache_layer_types
            )
            masked.pending, masked.pending_origin = layout.valid_mask, layout.origin
            masked.pending_columns = layout.seq_len
        if i in self.taps:  # scored as soon as the layer's projections have run
            self.taps[i].arm_with(
                lambda raw: TapResult(*self.importance(call, raw), None), layout.seq_len
            )
            self._pending[i] = None
            return
        self._pending[i] = self._score(call, None)

    def _score(self, call: LayerCall, tapped: TapResult | None) -> torch.Tensor:
        if tapped is None:
            with torch.no_grad():
                tapped = TapResult(*self.importance(call), None)
        assert call.state.trace is not None  # a prefill's state has its trace
        call.state.trace.relevance_flops += tapped.flops
        return tapped.relevance

    def prefill_post(self, call: LayerCall) -> None:
        st, i, cache = call.state, call.layer, call.cache
        tapped = self.taps[i].take() if i in self.taps else None
        if i not in self._pending or cache is None:
            return
        xi = self._pending.pop(i)
        if xi is None:  # armed: the tap's result, or the input projected again when it has none
            xi = self._score(call, tapped)
        layer = cache.layers[i]
        kind = self.rewrite(call, layer, xi)
        assert st.trace is not None  # a prefill's state has its trace
        stat = st.trace.layers[-1]
        st.trace.uncompressed[stat.layer] = stat
        valid = layer.valid
        st.trace.layers[-1] = LayerStat(
            stat.layer,
            int(valid.shape[1]),
            valid.sum(1),
            ((kind == TokenKind.VISION) & valid).sum(1),
            ((kind == TokenKind.STRUCTURAL) & valid).sum(1),
        )

    def end_forward(self) -> None:
        self._pending.clear()
        for tap in self.taps.values():  # a forward that raised mid-layer leaves no tap armed
            tap.take()


@Mode.register("cache")
@dataclass
class CacheMode(CacheEntriesMode):
    """Cache stages (``StageSpec.mode == "cache"``, i.e. ``cache=True``).

    Attributes:
        stages: the stages by layer.
    """

    own = False  # runs the stages that name it

    def start(self) -> None:
        self.stages = self.ctx.stages_in("cache")
        for stage in self.stages.values():
            problem = placement_problem(stage.spec, stage.relevance)
            if problem is not None:
                raise ValueError(problem)
        self.start_cache(self.stages)

    def reads_projections(self, layer):
        return ProjectionTap.wanted(self.stages[layer])

    def importance(self, call, raw=None):
        return self.ctx.relevance(self.stages[call.layer].relevance, call, raw)

    def rewrite(self, call, layer, importance):
        st, stage = call.state, self.stages[call.layer]
        with torch.no_grad():
            res = CacheStage(stage)(
                *layer.plain(), st.layout, importance, None, finish=drop_padding
            )
        # with proportional attention a merged entry keeps its size for the decoding masks
        layer.replace(
            res.keys,
            res.values,
            res.valid,
            res.origin,
            self.ctx.proportional.cache_sizes(res.result.sizes),
            self.ctx.proportional.channel(call.layer, st.impl),
        )
        st.trace.stages.append(StageRecord(layer=call.layer, stage=stage, result=res.result))
        return res.result.layout.kind
