"""What a compression session did to one prefill: per-layer cache lengths and KV bytes,
the kept vision fraction, provenance of every surviving token and estimated FLOPs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..graph.layout import TokenKind
from ..graph.provenance import Provenance
from ..policies.schedulers import TARGET_TOLERANCE
from .trace import LayerStat

__all__ = ["LayerReport", "SessionReport", "StageSummary"]


@dataclass(frozen=True)
class LayerReport:
    """One decoder layer, summed over the batch.

    Attributes:
        layer: index.
        length: cached entries per row (the padded width, holes included).
        tokens: real (non-hole, non-padding) cached tokens.
        vision: cached vision tokens (mergeable ones).
        structural: cached structural image tokens (e.g. row newlines).
        kv_bytes: bytes of the layer's key and value tensors as allocated.
        kv_bytes_vision: the part of ``kv_bytes`` that holds vision and structural tokens.
    """

    layer: int
    length: int
    tokens: int
    vision: int
    structural: int
    kv_bytes: int
    kv_bytes_vision: int


@dataclass(frozen=True)
class StageSummary:
    """One stage: where it ran and how many vision tokens it kept (summed over the batch)."""

    layer: int
    vision_in: int
    vision_out: int
    width_in: int
    width_out: int


@dataclass
class SessionReport:
    """Report of the last prefill of a `CompressionSession`.

    Attributes:
        pipeline: the pipeline's name.
        family: the adapter family.
        batch_size, input_len: the prompt batch.
        layers: one `LayerReport` per decoder layer.
        baseline: the same without compression (every layer holds the prompt).
        stages: one `StageSummary` per stage that ran.
        kept_vision_fraction: cached vision tokens averaged over layers, as a fraction of
            the prompt's vision tokens (1.0 when nothing was compressed; None without
            vision tokens).
        prefill_flops, prefill_flops_baseline: estimated decoder FLOPs of the prefill
            (projections, attention, MLP; the LM head and the vision encoder excluded) with
            and without compression; the compressed figure includes the compression's own
            projections and scores (``relevance_flops``: relevance and stage keys; only the
            scores when they were read from the layers' own projections, see
            `lightkv.adapters.tap`).
        target_kept_fraction: what the pipeline promised
            (`lightkv.Pipeline.target_kept_fraction`: the ``kept_fraction`` /
            ``budget`` schedules' target, H2O's budget on its layers, else what the stages'
            ratios would keep); None when it cannot be stated.
        provenance: for every prompt token, the index of the final token that represents it.
        num_prefills, num_forwards: forwards seen by the session so far.
    """

    pipeline: str
    family: str
    batch_size: int
    input_len: int
    layers: list[LayerReport]
    baseline: list[LayerReport]
    stages: list[StageSummary]
    kept_vision_fraction: float | None
    prefill_flops: float
    prefill_flops_baseline: float
    relevance_flops: float
    target_kept_fraction: float | None = None
    provenance: Provenance | None = field(default=None, repr=False)
    final_origin: torch.Tensor | None = field(default=None, repr=False)
    num_prefills: int = 0
    num_forwards: int = 0

    # ------------------------------------------------------------------ totals
    @property
    def missed_target(self) -> str | None:
        """A one-line warning when the achieved kept fraction differs from the target by
        more than `lightkv.policies.schedulers.TARGET_TOLERANCE` (e.g. a parity split asked
        to remove more than half a window, or a schedule on a model too shallow for it),
        else None."""
        want, got = self.target_kept_fraction, self.kept_vision_fraction
        if want is None or got is None or abs(got - want) <= TARGET_TOLERANCE:
            return None
        return (
            f"pipeline {self.pipeline!r} kept {got:.3f} of the vision KV, not the {want:.3f} it "
            f"targets (tolerance {TARGET_TOLERANCE}): its stages cannot remove that much on this "
            "model or these images (a parity split removes at most half a window per stage; small "
            "images are skipped); use more or earlier stages, or a policy that can remove more"
        )

    @property
    def kv_bytes(self) -> int:
        return sum(layer.kv_bytes for layer in self.layers)

    @property
    def kv_bytes_baseline(self) -> int:
        return sum(layer.kv_bytes for layer in self.baseline)

    @property
    def kv_bytes_vision(self) -> int:
        return sum(layer.kv_bytes_vision for layer in self.layers)

    @property
    def kv_bytes_vision_baseline(self) -> int:
        return sum(layer.kv_bytes_vision for layer in self.baseline)

    @property
    def kv_ratio(self) -> float:
        """Total KV bytes kept (compressed / baseline)."""
        return self.kv_bytes / self.kv_bytes_baseline if self.kv_bytes_baseline else 1.0

    @property
    def flops_ratio(self) -> float:
        return (
            self.prefill_flops / self.prefill_flops_baseline if self.prefill_flops_baseline else 1.0
        )

    def sources(self, row: int = 0) -> dict[int, list[int]]:
        """For every final token of batch row ``row`` that stands for prompt tokens, the
        prompt indices it represents (itself, plus everything merged into it)."""
        if self.provenance is None:
            return {}
        out: dict[int, list[int]] = {}
        for j, owner in enumerate(self.provenance.owner[row].tolist()):
            if owner >= 0:
                out.setdefault(owner, []).append(j)
        return out

    # ------------------------------------------------------------------ building
    @classmethod
    def from_session(cls, session) -> SessionReport:
        trace = session.last_prefill
        name = getattr(session.pipeline, "name", "custom")
        family = session.adapter.family
        if trace is None:
            return cls(
                name,
                family,
                0,
                0,
                [],
                [],
                [],
                None,
                0.0,
                0.0,
                0.0,
                num_prefills=session.num_prefills,
                num_forwards=session.num_forwards,
            )
        elem = torch.empty((), dtype=trace.kv_dtype or torch.float32).element_size()
        b, n0 = trace.batch_size, trace.input_len
        layers, baseline = [], []
        first = trace.layers[0] if trace.layers else None
        if first is not None:  # the cache mode compresses layer 0's cache after the layer ran
            first = trace.uncompressed.get(first.layer, first)
        pre_llm = any(rec.stage.spec.mode == "pre_llm" for rec in trace.stages)
        if first is not None and pre_llm and trace.layout is not None:
            # the pre-LLM mode compressed the prompt before layer 0 was counted: the baseline is the
            # prompt itself
            first = _prompt_stat(trace.layout, first.layer)
        flops = flops_base = 0.0
        for stat in trace.layers:
            assert first is not None  # set above from the non-empty trace.layers
            shape = session.layer_shapes[stat.layer]
            per_token = 2 * shape.kv_heads * shape.head_dim * elem
            vis = int(stat.vision.sum()) + int(stat.structural.sum())
            layers.append(
                LayerReport(
                    stat.layer,
                    stat.length,
                    int(stat.valid.sum()),
                    int(stat.vision.sum()),
                    int(stat.structural.sum()),
                    per_token * b * stat.length,
                    per_token * vis,
                )
            )
            vis0 = int(first.vision.sum()) + int(first.structural.sum())
            baseline.append(
                LayerReport(
                    stat.layer,
                    n0,
                    int(trace.input_valid.sum()),
                    int(first.vision.sum()),
                    int(first.structural.sum()),
                    per_token * b * n0,
                    per_token * vis0,
                )
            )
            ran = trace.uncompressed.get(
                stat.layer, stat
            ).length  # the cache mode: the layer ran on all tokens
            flops += b * shape.flops(ran, (ran + 1) / 2)
            flops_base += b * shape.flops(n0, (n0 + 1) / 2)
        flops += trace.relevance_flops
        kept = None
        if first is not None and int(first.vision.sum()) > 0:
            v0 = float(first.vision.sum())
            kept = sum(float(s.vision.sum()) / v0 for s in trace.layers) / len(trace.layers)
        stages = [
            StageSummary(
                layer=rec.layer,
                vision_in=_vision_in(trace, rec, first),
                vision_out=int(rec.result.layout.vision_mask.sum()),
                width_in=int(rec.result.remap.shape[1]),
                width_out=int(rec.result.kept_index.shape[1]),
            )
            for rec in trace.stages
        ]
        # H2O evicts inside the cache without a stage record: each evicting layer is a stage
        recorded = {rec.layer for rec in trace.stages}
        after = {stat.layer: stat for stat in trace.layers}
        stages += [
            StageSummary(
                layer,
                int(before.vision.sum()),
                int(after[layer].vision.sum()),
                before.length,
                after[layer].length,
            )
            for layer, before in sorted(trace.uncompressed.items())
            if layer not in recorded and layer in after
        ]
        stages.sort(key=lambda s: s.layer)
        return cls(
            pipeline=name,
            family=family,
            batch_size=b,
            input_len=n0,
            layers=layers,
            baseline=baseline,
            stages=stages,
            kept_vision_fraction=kept,
            target_kept_fraction=session.pipeline.target_kept_fraction(session.num_layers),
            prefill_flops=flops,
            prefill_flops_baseline=flops_base,
            relevance_flops=trace.relevance_flops,
            provenance=trace.provenance,
            final_origin=trace.final_layout.origin if trace.final_layout is not None else None,
            num_prefills=session.num_prefills,
            num_forwards=session.num_forwards,
        )

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary (provenance as per-row lists of owners)."""
        return {
            "pipeline": self.pipeline,
            "family": self.family,
            "batch_size": self.batch_size,
            "input_len": self.input_len,
            "layers": [asdict(layer) for layer in self.layers],
            "stages": [asdict(s) for s in self.stages],
            "kv_bytes": self.kv_bytes,
            "kv_bytes_baseline": self.kv_bytes_baseline,
            "kv_bytes_vision": self.kv_bytes_vision,
            "kv_bytes_vision_baseline": self.kv_bytes_vision_baseline,
            "kv_ratio": self.kv_ratio,
            "kept_vision_fraction": self.kept_vision_fraction,
            "target_kept_fraction": self.target_kept_fraction,
            "missed_target": self.missed_target,
            "prefill_flops": self.prefill_flops,
            "prefill_flops_baseline": self.prefill_flops_baseline,
            "relevance_flops": self.relevance_flops,
            "flops_ratio": self.flops_ratio,
            "provenance_owner": self.provenance.owner.tolist()
            if self.provenance is not None
            else None,
            "num_prefills": self.num_prefills,
            "num_forwards": self.num_forwards,
        }

    def __str__(self) -> str:
        if not self.layers:
            return f"lightkv session ({self.pipeline}, {self.family}): no prefill yet"
        kept = "n/a" if self.kept_vision_fraction is None else f"{self.kept_vision_fraction:.3f}"
        lines = [
            f"lightkv session: pipeline={self.pipeline} family={self.family} "
            f"batch={self.batch_size} prompt={self.input_len} tokens",
            f"  kept vision fraction (avg over layers): {kept}"
            + (
                ""
                if self.target_kept_fraction is None
                else f" (target {self.target_kept_fraction:.3f})"
            ),
            f"  KV bytes: {self.kv_bytes:,} / {self.kv_bytes_baseline:,} ({self.kv_ratio:.3f}); "
            f"vision {self.kv_bytes_vision:,} / {self.kv_bytes_vision_baseline:,}",
            f"  prefill FLOPs (est.): {self.prefill_flops:.3e} / {self.prefill_flops_baseline:.3e} "
            f"({self.flops_ratio:.3f}), relevance {self.relevance_flops:.3e}",
            "  layer  length  tokens  vision  struct  kv_bytes",
        ]
        for layer in self.layers:
            lines.append(
                f"  {layer.layer:5d}  {layer.length:6d}  {layer.tokens:6d}  {layer.vision:6d}  "
                f"{layer.structural:6d}  {layer.kv_bytes:,}"
            )
        for s in self.stages:
            lines.append(
                f"  stage after layer {s.layer}: vision {s.vision_in} -> {s.vision_out}, width "
                f"{s.width_in} -> {s.width_out}"
            )
        if self.missed_target:
            lines.append(f"  warning: {self.missed_target}")
        return "\n".join(lines)


def _prompt_stat(layout, layer: int) -> LayerStat:
    """Token counts of the uncompressed prompt, as if ``layer`` had seen it."""
    return LayerStat(
        layer,
        layout.seq_len,
        layout.valid_mask.sum(1),
        layout.vision_mask.sum(1),
        (layout.kind == TokenKind.STRUCTURAL).sum(1),
    )


def _vision_in(trace, rec, first) -> int:
    """Vision tokens a stage received: the prompt's for a pre-LLM stage, the layer's
    uncompressed cache for a cache stage, else the layer's input."""
    if rec.stage.spec.mode == "pre_llm":
        return int(first.vision.sum())
    if rec.stage.spec.mode == "cache" and rec.layer in trace.uncompressed:
        return int(trace.uncompressed[rec.layer].vision.sum())
    return _vision_before(trace, rec.layer)


def _vision_before(trace, layer: int) -> int:
    for stat in trace.layers:
        if stat.layer == layer:
            return int(stat.vision.sum())
    return 0
