"""The efficiency benchmark's run (`run`): every model's measurements
(`lightkv_lab.bench.efficiency.model_bench.bench_model`), with a progress
bar, the machine and the summary."""

from __future__ import annotations

import platform
import time
from dataclasses import asdict
from typing import Any

import torch

from lightkv_lab.bench.allocator import host_allocator
from lightkv_lab.bench.efficiency.model_bench import bench_model
from lightkv_lab.bench.efficiency.report import check_targets, summary_rows
from lightkv_lab.bench.efficiency.shapes import MODELS, BenchConfig
from lightkv_lab.bench.progress import Progress

__all__ = ["run"]


def _steps(cfg: BenchConfig) -> int:
    per_model = (cfg.warmup + cfg.repeats) * (1 + len(cfg.variants) + int(cfg.projection_baseline))
    if cfg.compares_reference_scoring:
        per_model += cfg.eager_repeats
    per_model += 1 if cfg.memory else 0
    return per_model * len(cfg.models)


def run(config: BenchConfig | None = None) -> dict[str, Any]:
    """Run the benchmark; returns a JSON-serialisable dict (see the module docstring)."""
    cfg = config or BenchConfig()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    from lightkv.policies import ExplicitSchedule, average_kept_fraction

    t0 = time.perf_counter()
    progress = Progress(_steps(cfg), "efficiency", quiet=not cfg.progress)
    models = {}
    try:
        with host_allocator(cfg.allocator) as heap:
            for name in cfg.models:
                models[name] = bench_model(MODELS[name], cfg, progress)
    finally:
        progress.close()
    ref_plan = ExplicitSchedule().plan(32)
    result = {
        "config": asdict(cfg),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "device": cfg.device,
            "device_name": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor(),
            "threads": torch.get_num_threads(),
            "allocator": heap,
        },
        "headline": "absolute times and ratios"
        if device.type == "cuda"
        else "ratios (CPU: absolute times are "
        "for reduced random-weight decoders on a shared machine)",
        "reductions": _reductions_note(cfg),
        "lightkv_reference_schedule": {
            "layers_of_32": [s.layer for s in ref_plan],
            "kept_vision_fraction_analytic": average_kept_fraction(ref_plan, 32),
        },
        "models": models,
        "seconds": time.perf_counter() - t0,
    }
    result["summary"] = summary_rows(result)
    result["targets"] = check_targets(result)
    return result


def _reductions_note(cfg: BenchConfig) -> str:
    parts = []
    for name in cfg.models:
        spec = MODELS[name]
        r, ref = spec.reduced(cfg.layers, cfg.heads, cfg.width == "full"), spec.ref
        parts.append(
            f"{spec.title}: {ref['layers']} -> {r['layers']} layers, width {ref['hidden']} -> "
            f"{r['hidden']} (heads {ref['heads']}/{ref['kv_heads']} -> "
            f"{r['heads']}/{r['kv_heads']}, head_dim 128, MLP {ref['intermediate']} -> "
            f"{r['intermediate']})"
        )
    return (
        "; ".join(parts)
        + ". Vision-token counts are the real ones; vision towers are 1-layer stand-ins. Explicit "
        "schedules are scaled to the reduced depth by `scale_layers` (layers left uncompressed by "
        "each stage scaled by depth ratio)."
    )
