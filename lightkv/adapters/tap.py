"""`ProjectionTap`: read a scheduled layer's own query and key projections while the layer
runs, so that relevance and stage keys cost no second projection.

Internals of `lightkv.adapters.session`. Projecting every vision token's query again at
each stage costs about a quarter of a layer's attention projections per stage (measured:
most of LightKV's overhead at 7B width). The layer computes exactly those projections of
exactly that input a moment later, so the tap hooks the projection modules the probe names
(`AttentionProbe.projections`), keeps their outputs for the one forward it is armed for,
and computes ξ as soon as the last of them has run (`ProjectionTap.arm`); the cache modes
score their entries the same way (`ProjectionTap.arm_with`). Nothing is copied: the outputs are the
tensors the attention uses. When the projections did not run as expected (an attention
module that never calls them, a shape the tap did not arm for) the session falls back to
projecting the input itself (`ProjectionTap.take` returns None).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..graph.layout import VisionLayout
from ..stage import Stage
from . import features
from .probes import AttentionProbe

__all__ = ["ProjectionTap", "TapResult"]


@dataclass
class TapResult:
    """What a tapped forward produced for the stage: ξ, its FLOPs and (when the stage needs
    them) the pre-RoPE key states ``[B, N, H_kv, d]``."""

    relevance: torch.Tensor
    flops: float
    key_states: torch.Tensor | None


@dataclass
class _Armed:
    rows: int
    score: Callable[[dict[str, torch.Tensor]], TapResult]
    raw: dict[str, torch.Tensor] = field(default_factory=dict)


class ProjectionTap:
    """Forward hooks on one layer's projection modules, armed for one forward at a time.

    Args:
        probe: the layer's probe (which modules, how raw outputs become queries and keys).
        layer: the layer's index (error messages).
    """

    def __init__(self, probe: AttentionProbe, layer: int):
        self.probe, self.layer = probe, layer
        self._armed: _Armed | None = None
        self._result: TapResult | None = None

    @staticmethod
    def wanted(stage: Stage) -> bool:
        """Whether ``stage`` reads anything the projections give (queries, keys)."""
        rel = stage.relevance
        if (
            rel.reads_tower or rel.reads_hidden
        ):  # computed before the layer from what the session holds
            return False
        return rel.query_rows != "none" or rel.key_cols != "none" or "key_states" in stage.needs

    def install(self) -> list[Any]:
        """Register the hooks; returns their handles (the session removes them)."""
        return [
            module.register_forward_hook(self._hook(name))
            for name, module in self.probe.projections().items()
        ]

    def arm(self, stage: Stage, pos, layout: VisionLayout, prompt=None) -> None:
        """Read the next forward of the projections (rows must be ``layout.seq_len``) for
        ``stage``'s relevance (and keys); ``prompt`` (the prefill's
        `lightkv.policies.Prompt`) is for a policy that reads it."""

        def score(raw: dict[str, torch.Tensor]) -> TapResult:
            xi, flops = features.relevance(
                self.probe, stage.relevance, None, pos, layout, self.layer, raw=raw, prompt=prompt
            )
            key_states = (
                features.stage_key_states(self.probe, None, raw=raw)[0]
                if "key_states" in stage.needs
                else None
            )
            return TapResult(xi, flops, key_states)

        self.arm_with(score, layout.seq_len)

    def arm_with(self, score: Callable[[dict[str, torch.Tensor]], TapResult], rows: int) -> None:
        """Read the next forward of the projections (``rows`` tokens) and hand their raw
        outputs (by `AttentionProbe.projections` name) to ``score``, under ``no_grad``, as
        soon as the last of them has run: what a cache mode scores its entries with."""
        self._armed, self._result = _Armed(rows, score), None

    def take(self) -> TapResult | None:
        """The result of the armed forward (None when the projections did not all run);
        disarms."""
        result, self._armed, self._result = self._result, None, None
        return result

    def _hook(self, name: str):
        def hook(module, args, output):
            armed = self._armed
            if armed is None or not isinstance(output, torch.Tensor) or output.dim() != 3:
                return
            if output.shape[1] != armed.rows or name in armed.raw:
                self._armed = None  # not the forward we armed for: leave it to the fallback
                return
            armed.raw[name] = output
            if len(armed.raw) == len(self.probe.projections()):
                self._armed = None
                self._result = self._compute(armed)

        return hook

    @staticmethod
    def _compute(armed: _Armed) -> TapResult:
        with torch.no_grad():
            return armed.score({k: v.detach() for k, v in armed.raw.items()})
