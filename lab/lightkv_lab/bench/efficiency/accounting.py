"""The efficiency benchmark's accounting: KV bytes read from a prefill's cache, and the
analytic FLOPs of the full-size reference decoder (`lightkv.adapters.probes.LayerShape`) with
a preset's unscaled schedule and a run's per-stage token counts."""

from __future__ import annotations

from typing import Any

from lightkv_lab.bench.efficiency.shapes import ModelSpec, preset_pipeline
from lightkv_lab.bench.efficiency.specs import HEAD_DIM

__all__ = ["kv_from_cache", "reference_flops", "reference_shape_flops"]


def kv_from_cache(cache, report) -> dict[str, Any]:
    """Total KV bytes from the cache tensors; the vision part as those tensors' bytes per
    entry times the vision (and structural) entries the session report counts per layer."""
    total = vision = 0
    lengths = []
    for i, layer in enumerate(cache.layers):
        nbytes = (
            layer.keys.numel() * layer.keys.element_size()
            + layer.values.numel() * layer.values.element_size()
        )
        length = int(layer.keys.shape[-2])
        total += nbytes
        lengths.append(length)
        if report is not None:
            lr = report.layers[i]
            vision += nbytes // max(1, length * layer.keys.shape[0]) * (lr.vision + lr.structural)
    return {"kv_bytes": total, "kv_bytes_vision": vision, "cache_lengths": lengths}


def reference_shape_flops(spec: ModelSpec, name: str, report, n0: int) -> dict[str, float]:
    """FLOPs ratio and kept vision / total KV fractions on the full-size reference decoder,
    with the preset's own (unscaled) schedule and the per-stage token counts of this run."""
    ref, shape = spec.ref, reference_layer_shape(spec)
    pipe = preset_pipeline(name, spec)
    plan = pipe.plan(ref["layers"])
    modes = set(pipe.modes(ref["layers"]))
    if modes and modes <= {"cache", "h2o"}:
        # the cache mode: the prefill is the uncompressed one, every layer's cache is cut the same
        # way
        return {
            "flops_ratio_reference_shape": 1.0,
            "kept_vision_fraction_reference_depth": report.kept_vision_fraction,
            "kv_ratio_reference_depth": report.kv_ratio,
            "reference_schedule": list(range(ref["layers"])),
        }
    stages = report.stages
    if len(plan) != len(stages):  # a depth-dependent schedule: not comparable stage by stage
        return {}
    prompt = (
        report.baseline[0] if report.baseline else report.layers[0]
    )  # before any stage, pre-LLM ones too
    length, vision = n0, prompt.vision + prompt.structural
    v0, lengths, visions = vision, [], []
    before = {p.layer: s for p, s in zip(plan, stages) if p.mode == "pre_llm"}
    after = {p.layer: s for p, s in zip(plan, stages) if p.mode != "pre_llm"}
    for layer in range(ref["layers"]):
        for at in (
            before,
            after,
        ):  # a pre-LLM stage shortens layer 0 itself, the others the next layer
            if layer in at:
                s = at[layer]
                length, vision = s.width_out, vision - (s.vision_in - s.vision_out)
            if at is before:
                lengths.append(length)
                visions.append(vision)
    flops = sum(shape.flops(l, (l + 1) / 2) for l in lengths)
    base = ref["layers"] * shape.flops(n0, (n0 + 1) / 2)
    return {
        "flops_ratio_reference_shape": flops / base,
        "kept_vision_fraction_reference_depth": sum(visions) / (v0 * ref["layers"]) if v0 else 1.0,
        "kv_ratio_reference_depth": sum(lengths) / (n0 * ref["layers"]),
        "reference_schedule": [p.layer for p in plan],
    }


def reference_layer_shape(spec: ModelSpec):
    """One decoder layer of the full-size reference model (`LayerShape`, for FLOPs)."""
    from lightkv.adapters.probes import LayerShape

    ref = spec.ref
    return LayerShape(
        hidden=ref["hidden"],
        heads=ref["heads"],
        kv_heads=ref["kv_heads"],
        head_dim=HEAD_DIM,
        mlp_hidden=ref["intermediate"],
        mlp_matrices=3,
    )


def reference_flops(spec: ModelSpec, n0: int) -> float:
    return spec.ref["layers"] * reference_layer_shape(spec).flops(n0, (n0 + 1) / 2)
