"""The ``layer`` mode: a stage on a decoder layer's output hidden states (LightKV, ToMe,
FastV, PyramidDrop): every later layer runs on, and caches, the shorter sequence.

Relevance comes from the layer's own query / key projections as the layer runs (a
`ProjectionTap`, armed before the layer); when they did not run as the tap expected, the
layer's input is projected once more after it ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..tap import ProjectionTap
from .base import LayerCall, Mode
from .hidden import compress, prepare

__all__ = ["LayerMode"]


@Mode.register("layer")
@dataclass
class LayerMode(Mode):
    """Stages after decoder layers (``StageSpec.mode == "layer"``, the default).

    Attributes:
        stages: the stages by layer.
        taps: the projection taps by layer (empty with ``reuse_projections=False``).
    """

    own = False  # runs the stages that name it

    order = 20

    def start(self) -> None:
        ctx = self.ctx
        self.stages = ctx.stages_in("layer")
        self.layers = frozenset(self.stages)
        self.taps = {
            i: ProjectionTap(ctx.probes[i], i)
            for i, s in self.stages.items()
            if ctx.reuse_projections and ProjectionTap.wanted(s)
        }

    def install(self) -> list[Any]:
        return [h for tap in self.taps.values() for h in tap.install()]

    def prefill_pre(self, call: LayerCall) -> None:
        st, i = call.state, call.layer
        if st.layout is None:
            return
        pos = call.kwargs.get("position_embeddings")
        if i in self.taps:
            self.taps[i].arm(self.stages[i], pos, st.layout, st.prompt)
        else:
            prepare(self.ctx, st, i, self.stages[i], call.hidden, pos, st.layout)

    def prefill_post(self, call: LayerCall) -> None:
        st, i = call.state, call.layer
        tapped = self.taps[i].take() if i in self.taps else None
        if st.layout is None:
            return
        if tapped is not None:
            st.pending_relevance, st.pending_key_states, st.pending_tapped = (
                tapped.relevance,
                tapped.key_states,
                True,
            )
            assert st.trace is not None  # a prefill's state has its trace
            st.trace.relevance_flops += tapped.flops
        elif i in self.taps:  # the projections did not run as the tap expected: project the input
            prepare(
                self.ctx,
                st,
                i,
                self.stages[i],
                call.hidden,
                call.kwargs.get("position_embeddings"),
                st.layout,
            )
        call.replace_output(compress(self.ctx, st, i, self.stages[i], call.output_hidden))

    def end_forward(self) -> None:
        for tap in self.taps.values():  # a forward that raised mid-layer leaves no tap armed
            tap.take()
