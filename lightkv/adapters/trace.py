"""What a `CompressionSession` records about one prefill: `PrefillTrace` (per-layer
`LayerStat` token counts and one `StageRecord` per stage).

Read it to use ``session.last_prefill`` or ``session.records`` (e.g. in tests);
`lightkv.adapters.report.SessionReport` summarises a trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..graph.layout import VisionLayout
from ..graph.provenance import Provenance
from ..stage import Stage, StageResult

__all__ = ["ForwardState", "LayerStat", "PrefillTrace", "StageRecord"]


@dataclass
class StageRecord:
    """One stage as it ran inside the model.

    Always present: ``layer``, ``result`` (the `StageResult`) and ``tapped`` (relevance
    read from the layer's own projections as it ran, not projected again). With
    ``record=True`` also the stage's exact inputs, so tests can re-run the pure `Stage`.
    """

    layer: int
    stage: Stage
    result: StageResult
    tapped: bool = False
    hidden: torch.Tensor | None = None
    layout: VisionLayout | None = None
    relevance: torch.Tensor | None = None
    provenance: Provenance | None = None
    key_states: torch.Tensor | None = None
    tower: dict[int, torch.Tensor] | None = None


@dataclass
class LayerStat:
    """Token counts of one decoder layer during a prefill (tensors ``[B]``).

    Attributes:
        layer: index.
        length: width of the layer's input / cache entries (holes included).
        valid: real tokens per row.
        vision: vision tokens per row.
        structural: structural (never merged) image tokens per row.
    """

    layer: int
    length: int
    valid: torch.Tensor
    vision: torch.Tensor
    structural: torch.Tensor


@dataclass
class PrefillTrace:
    """Everything one prefill did (what `lightkv.adapters.report.SessionReport` reads)."""

    batch_size: int
    input_len: int
    layout: VisionLayout | None
    input_valid: torch.Tensor
    layers: list[LayerStat] = field(default_factory=list)
    stages: list[StageRecord] = field(default_factory=list)
    final_layout: VisionLayout | None = None
    provenance: Provenance | None = None
    relevance_flops: float = 0.0
    kv_dtype: torch.dtype | None = None
    uncompressed: dict[int, LayerStat] = field(default_factory=dict)
    """The cache mode: each compressed layer's counts before its cache was compressed."""

    def to_prompt_positions(self, t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Put a per-token output of this prefill (``[B, N', ...]``, e.g. ``logits``) back
        at the prompt positions its tokens came from: ``[B, N0, ...]``, ``fill`` where a
        prompt token no longer has its own column (merged, dropped or padding)."""
        layout = self.final_layout
        if layout is None:
            return t
        origin = layout.origin
        if t.shape[:2] != origin.shape:
            raise ValueError(
                f"expected [B, N'] = {tuple(origin.shape)} leading dims, got {tuple(t.shape)}"
            )
        out = t.new_full((t.shape[0], self.input_len, *t.shape[2:]), fill)
        b, n = origin.shape
        rows = torch.arange(b, device=origin.device).unsqueeze(1).expand(b, n)
        keep = origin >= 0
        out[rows[keep], origin[keep]] = t[keep]
        return out


@dataclass
class ForwardState:
    """What the session tracks during one forward of the model (prefill or decode step)."""

    phase: str  # "prefill" | "decode": which of the modes' hook methods run
    impl: str
    layout: VisionLayout | None = None
    new_valid: torch.Tensor | None = None
    past: int = 0
    provenance: Provenance | None = None
    compressed: bool = False
    full_pos: tuple[torch.Tensor, torch.Tensor] | None = None
    full_pos_ids: torch.Tensor | None = None
    pos: tuple[torch.Tensor, torch.Tensor] | None = None
    pos_ids: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)  # adapter.mask_key(layer) -> prefill mask
    gathered: dict = field(default_factory=dict)  # id(full position embeddings) -> (full, gathered)
    pending_relevance: torch.Tensor | None = None
    pending_key_states: torch.Tensor | None = None
    pending_tapped: bool = False
    trace: PrefillTrace | None = None
    prompt: Any = None  # the prefill's lightkv.policies.Prompt (its input_ids)
