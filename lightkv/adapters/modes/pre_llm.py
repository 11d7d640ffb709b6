"""The ``pre_llm`` mode: one stage on the embeddings, before decoder layer 0
(`lightkv.policies.PreLLMSchedule`; VisionZip, DivPrune, CDPruner, vLLM-style pruning).

Every decoder layer then runs on, and caches, the shorter sequence. Relevance comes from
layer 0's own projections of its input, computed before the layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import LayerCall, Mode
from .hidden import compress, prepare

__all__ = ["PreLLMMode"]


@Mode.register("pre_llm")
@dataclass
class PreLLMMode(Mode):
    """Stages on a layer's input (``StageSpec.mode == "pre_llm"``).

    Attributes:
        stages: the stages by layer (layer 0 only: `StageSpec` refuses others).
    """

    own = False  # runs the stages that name it

    order = 0  # before `sequence` records the layer's (already shorter) input

    def start(self) -> None:
        ctx = self.ctx
        self.stages = ctx.stages_in("pre_llm")
        self.layers = frozenset(self.stages)

    def prefill_pre(self, call: LayerCall) -> None:
        st = call.state
        if st.layout is None:
            return
        call.check_layout()
        stage = self.stages[call.layer]
        # the full-length positions, which `compress` gathers for the shorter sequence
        st.full_pos, st.full_pos_ids = (
            call.kwargs.get("position_embeddings"),
            call.kwargs.get("position_ids"),
        )
        prepare(self.ctx, st, call.layer, stage, call.hidden, st.full_pos, st.layout)
        call.hidden = compress(self.ctx, st, call.layer, stage, call.hidden)
