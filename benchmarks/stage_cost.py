"""How much does one compression stage cost next to one decoder layer? (CPU, fp32)

Times, at LLaVA shapes, one lightkv `Stage` (the first stage of the ``lightkv`` preset,
4x4 windows, and its last, global-window stage) for every available scatter backend, next
to a yardstick: one LLaMA-7B-sized decoder layer's prefill on the same sequence (RMSNorm,
q/k/v/o projections 4096x4096 with rotary embeddings, causal SDPA with 32 heads, SiLU-gated
MLP 4096 -> 11008 -> 4096; random fp32 weights, ``torch.nn.functional`` only). The target
is a stage costing under 5% of the layer.

Shapes:

* ``llava-1.5``: 35 text tokens, a 24x24 image (576 vision tokens), 5 text tokens;
  batch 1 and 8.
* ``llava-next``: 35 text tokens, a 24x24 base image, a 48x48 image stored row by row with
  one newline token per row (2,880 vision + 48 structural tokens), 5 text tokens; batch 1.

Both stages are timed on the uncompressed sequence (the global-window stage normally sees
the survivors of the earlier stages; on the full sequence it is its worst case).
Each number is the median of ``--repeats`` timed runs after a warm-up run, inside
``torch.inference_mode()``, with torch's default thread count.

Run ``python benchmarks/stage_cost.py`` (``make bench``); ``--quick`` times only the
LLaVA-1.5 batch-1 shape. Results go to ``benchmarks/results/stage_cost.json``
(``stage_cost-quick.json`` with ``--quick``); ``--profile`` adds a torch.profiler table of
the first stage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

import lightkv
from lightkv import ImageSegment, VisionLayout
from lightkv.graph import scatter
from lightkv.outputs import write_atomic

HIDDEN = 4096
HEADS = 32
INTERMEDIATE = 11008
TEXT_BEFORE = 35
TEXT_AFTER = 5
TARGET = 0.05
RESULTS = Path(__file__).resolve().parent / "results"


# ---------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    name: str
    batch: int

    def segments(self, row: int) -> list[ImageSegment]:
        if self.name == "llava-1.5":
            return [ImageSegment(row, TEXT_BEFORE, (24, 24))]
        if self.name == "llava-next":
            base = ImageSegment(row, TEXT_BEFORE, (24, 24))
            tiles = ImageSegment(row, TEXT_BEFORE + base.length, (48, 48), newline_every=48)
            return [base, tiles]
        raise ValueError(f"unknown shape {self.name!r}")

    @property
    def image_len(self) -> int:
        return sum(s.length for s in self.segments(0))

    @property
    def seq_len(self) -> int:
        return TEXT_BEFORE + self.image_len + TEXT_AFTER

    def inputs(self, seed: int = 0) -> tuple[torch.Tensor, VisionLayout, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        b, n = self.batch, self.seq_len
        segments = [s for row in range(b) for s in self.segments(row)]
        layout = VisionLayout.from_segments(b, n, segments)
        hidden = torch.randn(b, n, HIDDEN, generator=gen)
        relevance = torch.rand(b, n, generator=gen)
        return hidden, layout, relevance


# ---------------------------------------------------------------------- yardstick
class DecoderLayer:
    """A LLaMA-7B decoder layer (prefill) on random fp32 weights, functional style."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)

        def w(out_f: int, in_f: int) -> torch.Tensor:
            return torch.randn(out_f, in_f, generator=gen) * in_f**-0.5

        self.wq, self.wk, self.wv, self.wo = (w(HIDDEN, HIDDEN) for _ in range(4))
        self.wg, self.wu = w(INTERMEDIATE, HIDDEN), w(INTERMEDIATE, HIDDEN)
        self.wd = w(HIDDEN, INTERMEDIATE)
        self.norm1 = torch.ones(HIDDEN)
        self.norm2 = torch.ones(HIDDEN)
        head = HIDDEN // HEADS
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, head, 2, dtype=torch.float32) / head))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        head = d // HEADS
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        h = F.rms_norm(x, (d,), self.norm1, eps=1e-6)
        q = F.linear(h, self.wq).view(b, n, HEADS, head).transpose(1, 2)
        k = F.linear(h, self.wk).view(b, n, HEADS, head).transpose(1, 2)
        v = F.linear(h, self.wv).view(b, n, HEADS, head).transpose(1, 2)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(attn.transpose(1, 2).reshape(b, n, d), self.wo)
        h = F.rms_norm(x, (d,), self.norm2, eps=1e-6)
        return x + F.linear(F.silu(F.linear(h, self.wg)) * F.linear(h, self.wu), self.wd)


# ---------------------------------------------------------------------- timing
def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``fn`` in ms over ``repeats`` runs after ``warmup`` runs."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def profile_stage(stage, hidden, layout, relevance, rows: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        stage(hidden, layout, relevance)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            stage(hidden, layout, relevance)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only LLaVA-1.5, batch 1")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per measurement (>= 5 recommended)"
    )
    parser.add_argument(
        "--stage-repeats", type=int, default=10, help="timed runs per stage measurement"
    )
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON path (default: benchmarks/results/...)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="print a torch.profiler table of the first stage"
    )
    args = parser.parse_args(argv)

    shapes = (
        [Shape("llava-1.5", 1)]
        if args.quick
        else [Shape("llava-1.5", 1), Shape("llava-1.5", 8), Shape("llava-next", 1)]
    )
    output = args.output or RESULTS / ("stage_cost-quick.json" if args.quick else "stage_cost.json")
    stages = lightkv.load("lightkv").stages(32)
    timed = {"first (4x4 windows)": stages[0], "last (global window)": stages[-1]}
    layer = DecoderLayer()
    backends = scatter.available_backends()

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"scatter backends: {', '.join(backends)}"
    )
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    rows, profiles = [], {}
    for shape in shapes:
        hidden, layout, relevance = shape.inputs()
        layer_ms, layer_runs = median_ms(partial(layer, hidden), args.repeats)
        print(
            f"{shape.name} B={shape.batch} N={shape.seq_len}: decoder layer {layer_ms:.1f} ms "
            "(median)",
            flush=True,
        )
        for backend in backends:
            with scatter.use_backend(backend):
                for label, stage in timed.items():
                    stage_ms, stage_runs = median_ms(
                        partial(stage, hidden, layout, relevance),
                        max(args.repeats, args.stage_repeats),
                    )
                    with torch.inference_mode():
                        kept = stage(hidden, layout, relevance).layout.vision_counts().tolist()
                    rows.append(
                        {
                            "shape": shape.name,
                            "batch": shape.batch,
                            "seq_len": shape.seq_len,
                            "vision_tokens": int(layout.vision_counts()[0]),
                            "backend": backend,
                            "stage": label,
                            "stage_layer": stage.spec.layer,
                            "windows_per_side": stage.spec.windows_per_side,
                            "vision_kept": kept[0],
                            "stage_median_ms": round(stage_ms, 3),
                            "layer_median_ms": round(layer_ms, 3),
                            "ratio": round(stage_ms / layer_ms, 5),
                            "stage_runs_ms": [round(t, 3) for t in stage_runs],
                            "layer_runs_ms": [round(t, 3) for t in layer_runs],
                        }
                    )
                    print(
                        f"  {backend:<14}{label:<22}{stage_ms:9.2f} ms  "
                        f"({100 * stage_ms / layer_ms:.2f}% of the layer)",
                        flush=True,
                    )
            if args.profile and backend == backends[0]:
                profiles[f"{shape.name} B={shape.batch}"] = profile_stage(
                    stages[0], hidden, layout, relevance
                )

    output.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": sys.version.split()[0],
        "dtype": "float32",
        "repeats": args.repeats,
        "stage_repeats": max(args.repeats, args.stage_repeats),
        "target_ratio": TARGET,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "note": "median wall time after one warm-up run; both stages timed on the uncompressed "
        "sequence",
    }
    write_atomic(output, json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")

    header = (
        f"{'shape':<11}{'B':>3}{'N':>6}{'backend':>15}  {'stage':<22}{'kept':>6}{'stage ms':>10}"
        f"{'layer ms':>11}{'stage/layer':>13}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        flag = "" if r["ratio"] < TARGET else "  > 5%"
        print(
            f"{r['shape']:<11}{r['batch']:>3}{r['seq_len']:>6}{r['backend']:>15}  "
            f"{r['stage']:<22}{r['vision_kept']:>6}{r['stage_median_ms']:>10.2f}"
            f"{r['layer_median_ms']:>11.1f}{100 * r['ratio']:>12.2f}%{flag}"
        )
    print(f"\nwrote {output}")
    for name, table in profiles.items():
        print(f"\ntorch.profiler, first stage, {name} (self CPU time):\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
