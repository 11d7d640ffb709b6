"""What the two hidden-state modes share (``layer`` and ``pre_llm``): relevance for a stage
from a layer's own projections, running the pure `lightkv.Stage`, and the positions of the
shorter sequence that every later layer receives (`lightkv.adapters.modes.sequence`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from ...stage import Stage
from .. import features
from ..masks import drop_padding, gather_position_ids, gather_tokens
from ..trace import ForwardState, StageRecord
from .base import SessionContext
from .tower import TowerMode

if TYPE_CHECKING:
    from .tower import TowerMode

__all__ = ["compress", "prepare"]


def prepare(
    ctx: SessionContext,
    st: ForwardState,
    i: int,
    stage: Stage,
    hidden: torch.Tensor,
    position_embeddings,
    layout,
) -> None:
    """Relevance (and keys, when a policy needs them) from layer ``i``'s own projections
    of its input, for the stage that runs next (kept in ``st.pending_*``)."""
    with torch.no_grad():
        probe = ctx.probes[i]
        # relevance that reads the vision tower's attention needs the tower mode, which
        # `choose_modes` starts for exactly such stages
        tower = (
            cast("TowerMode", ctx.modes["tower"]).per_token(layout)
            if stage.relevance.reads_tower
            else None
        )
        st.pending_relevance, flops = features.relevance(
            probe,
            stage.relevance,
            hidden,
            position_embeddings,
            layout,
            i,
            prompt=st.prompt,
            tower=tower,
        )
        st.pending_key_states, key_flops = (
            features.stage_key_states(probe, hidden) if "key_states" in stage.needs else (None, 0.0)
        )
        assert st.trace is not None  # a prefill's state has its trace
        st.trace.relevance_flops += flops + key_flops


def compress(
    ctx: SessionContext, st: ForwardState, i: int, stage: Stage, hidden: torch.Tensor
) -> torch.Tensor:
    """Run ``stage`` on ``hidden`` with the pending relevance; the forward continues with
    the shorter sequence (``st`` gets its layout, provenance and positions)."""
    layout, provenance = st.layout, st.provenance
    relevance, key_states = st.pending_relevance, st.pending_key_states
    assert layout is not None and st.trace is not None  # a prefill with vision tokens
    # the tower layers a policy reads besides the relevance (VScan's local scan)
    tower = None
    if stage.tower_layers:
        tower_mode = ctx.modes["tower"]
        assert isinstance(tower_mode, TowerMode)  # stages that read the tower start it
        tower = {t: tower_mode.per_token(layout, t) for t in stage.tower_layers}
    result = drop_padding(
        stage(hidden, layout, relevance, provenance, key_states, st.prompt, tower)
    )
    record = StageRecord(layer=i, stage=stage, result=result, tapped=st.pending_tapped)
    if ctx.record:
        record.hidden, record.layout, record.relevance = hidden, layout, relevance
        record.provenance, record.key_states, record.tower = provenance, key_states, tower
    st.trace.stages.append(record)
    st.layout, st.provenance = result.layout, result.provenance
    st.pending_relevance = st.pending_key_states = None
    st.pending_tapped = False
    st.compressed = True
    _refresh(ctx, st)
    return result.hidden


def _refresh(ctx: SessionContext, st: ForwardState) -> None:
    """Position embeddings, position ids and (cleared) masks of the current sequence."""
    assert st.layout is not None and st.trace is not None  # set by compress
    index = st.layout.origin.clamp_min(0)
    if st.full_pos is not None:
        cos, sin = st.full_pos
        st.pos = (gather_tokens(cos, index), gather_tokens(sin, index))
    st.pos_ids = gather_position_ids(st.full_pos_ids, index)
    # the released code's plain 0..N'-1 after a merge (a no-op unless asked for)
    st.pos, st.pos_ids = ctx.released.positions(
        st.layout, st.trace.input_valid, st.full_pos, st.pos, st.pos_ids
    )
    st.masks, st.gathered = {}, {}
