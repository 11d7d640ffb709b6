"""What a `CompressionSession` records about one prefill: `PrefillTrace` (per-layer
`LayerStat` token counts and one `StageRecord` per stage).

Read it to use ``session.last_prefill`` or ``session.records`` (e.g. in tests);
`lightkv.adapters.report.SessionReport` summarises a trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..graph.layout import VisionLayout
from ..graph.provenance import Provenance
from ..pipeline import Stage, StageResult

__all__ = ["LayerStat", "PrefillTrace", "StageRecord"]


@dataclass
class StageRecord:
    """One stage as it ran inside the model.

    Always present: ``layer``, ``result`` (the `StageResult`). With ``record=True`` also the
    stage's exact inputs, so tests can re-run the pure `Stage` and compare.
    """

    layer: int
    stage: Stage
    result: StageResult
    hidden: torch.Tensor | None = None
    layout: VisionLayout | None = None
    relevance: torch.Tensor | None = None
    provenance: Provenance | None = None
    keys: torch.Tensor | None = None


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
