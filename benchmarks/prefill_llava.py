"""Prefill cost with and without LightKV on LLaVA-1.5- and LLaVA-NeXT-shaped random models.

The decoder is reduced (default 16 layers, width 256) but the vision-token counts are the
real ones: 576 (a 24 x 24 grid) for LLaVA-1.5 and 2,928 (a 24 x 24 base grid plus a
48 x 48 high-resolution grid with row newlines, a square 2 x 2-tile image) for LLaVA-NeXT.
LightKV runs with the preset's policies at the same relative depths as the reference
schedule (12/18/24 of 32 layers -> 6/9/12 of 16), 4/2/1 windows per side, half per stage.

Measured per shape and variant (batch 1): prefill wall time (a forward that fills the
cache and returns the last token's logits, as ``generate`` does; variants interleaved,
minimum and median over repeats), KV-cache bytes (the
cache tensors as allocated), the kept vision fraction and estimated FLOPs from the session
report, and peak memory (CUDA: ``max_memory_allocated``; CPU: peak resident memory of a
fresh subprocess, sampled every 0.2 ms during the prefill, above its level just before).

    python benchmarks/prefill_llava.py   # both shapes, CPU, JSON to benchmarks/results/
    python benchmarks/prefill_llava.py --device cuda --dtype bfloat16 --layers 32 --hidden 4096
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightkv_lab.tiny.llava_next import build_llava_next

import lightkv
from lightkv import Pipeline
from lightkv.adapters import apply
from lightkv.outputs import write_atomic
from lightkv.policies import ExplicitSchedule
from lightkv.testing import IMAGE, build_llava, text_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lightkv_pipeline(num_layers: int) -> Pipeline:
    """The LightKV preset with its schedule scaled to ``num_layers``."""
    layers = tuple(round(f * num_layers) for f in (12 / 32, 18 / 32, 24 / 32))
    return lightkv.load("lightkv").with_scheduler(
        ExplicitSchedule(layers=layers, windows_per_side=(4, 2, 1), removal_ratios=(0.5,))
    )


def build(shape: str, args) -> tuple[torch.nn.Module, dict]:
    sizes = dict(
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_heads=args.heads,
        num_kv_heads=args.heads,
    )
    g = torch.Generator().manual_seed(0)
    if shape == "llava":
        model = build_llava(image_size=48, patch_size=2, **sizes)  # 24 x 24 = 576 tokens
        n_vis = 576
        pixels = {"pixel_values": torch.randn(1, 3, 48, 48, generator=g)}
    elif shape == "llava_next":
        model = build_llava_next(
            image_size=48, patch_size=2, pinpoints=((96, 96), (48, 96), (96, 48)), **sizes
        )
        n_vis = 24 * 24 + 48 * 49  # base + 2x2-tile high-res grid with newlines = 2,928
        pixels = {
            "pixel_values": torch.randn(1, 5, 3, 48, 48, generator=g),
            "image_sizes": torch.tensor([[96, 96]]),
        }
    else:
        raise ValueError(shape)
    ids = torch.cat([text_ids(20, g), torch.full((n_vis,), IMAGE), text_ids(15, g)]).unsqueeze(0)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **pixels}
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    model = model.to(device=device, dtype=dtype)
    inputs = {
        k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
        for k, v in inputs.items()
    }
    return model, inputs


def prefill(model, inputs):
    out = model(**inputs, use_cache=True, logits_to_keep=1)
    if inputs["input_ids"].is_cuda:
        torch.cuda.synchronize()
    return out


def timed_prefill(model, inputs, pipe) -> tuple[float, object, object]:
    """One prefill (inside a session when ``pipe`` is given): ``(seconds, output, session)``."""
    with torch.no_grad():
        if pipe is None:
            t0 = time.perf_counter()
            out = prefill(model, inputs)
            return time.perf_counter() - t0, out, None
        with apply(pipe, model) as session:
            t0 = time.perf_counter()
            out = prefill(model, inputs)
            return time.perf_counter() - t0, out, session


def run_shape(model, inputs, args) -> dict:
    """Both variants, interleaved (baseline, lightkv, baseline, ...) so that load from other
    processes hits both alike; the minimum over repeats is the robust figure."""
    pipes = {"baseline": None, "lightkv": lightkv_pipeline(args.layers)}
    times = {v: [] for v in pipes}
    last = {}
    for i in range(args.warmup + args.repeats):
        for variant, pipe in pipes.items():
            dt, out, session = timed_prefill(model, inputs, pipe)
            if i >= args.warmup:
                times[variant].append(dt)
            last[variant] = (out, session)
    entry = {}
    for variant in pipes:
        out, session = last[variant]
        layers = out.cache.layers
        kv = sum(
            l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
            for l in layers
        )
        result = {
            "prefill_s_min": min(times[variant]),
            "prefill_s_median": statistics.median(times[variant]),
            "prefill_s_all": times[variant],
            "kv_bytes": kv,
            "cache_lengths": [l.keys.shape[2] for l in layers],
        }
        if session is not None:
            report = session.report()
            result.update(
                kept_vision_fraction=report.kept_vision_fraction,
                flops_estimate=report.prefill_flops,
                flops_estimate_baseline=report.prefill_flops_baseline,
                relevance_flops=report.relevance_flops,
                kv_bytes_vision=report.kv_bytes_vision,
                kv_bytes_vision_baseline=report.kv_bytes_vision_baseline,
            )
        entry[variant] = result
    return entry


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _RssPeak:
    """Samples the resident set size in a thread; ``peak`` is the maximum seen."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.0002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def child(shape: str, variant: str, args) -> None:
    """Peak memory of one prefill, in a fresh process (printed as JSON)."""
    torch.set_num_threads(args.threads)
    model, inputs = build(shape, args)
    pipe = lightkv_pipeline(args.layers) if variant == "lightkv" else None

    def once():
        with torch.no_grad():
            if pipe is None:
                return prefill(model, inputs)
            with apply(pipe, model):
                return prefill(model, inputs)

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = once()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = _rss()
        with _RssPeak() as sampler:
            out = once()
        peak = sampler.peak - base
    del out
    print(json.dumps({"peak_bytes_above_model": int(peak)}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shapes", nargs="+", default=["llava", "llava_next"], choices=["llava", "llava_next"]
    )
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--no-memory", action="store_true", help="skip the per-variant subprocess memory runs"
    )
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefill_llava.json"))
    p.add_argument("--child", nargs=2, metavar=("SHAPE", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child, args)
        return 0
    torch.set_num_threads(args.threads)
    results = {
        "config": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "device_name": torch.cuda.get_device_name()
            if args.device == "cuda"
            else platform.processor(),
        },
        "shapes": {},
    }
    for shape in args.shapes:
        model, inputs = build(shape, args)
        entry = {"prompt_tokens": int(inputs["input_ids"].shape[1])}
        entry.update(run_shape(model, inputs, args))
        for variant in ("baseline", "lightkv"):
            if not args.no_memory:
                cmd = [sys.executable, __file__, "--child", shape, variant] + _forward_args(args)
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                entry[variant].update(json.loads(done.stdout.strip().splitlines()[-1]))
        base, comp = entry["baseline"], entry["lightkv"]
        entry["ratios"] = {
            "prefill_time": comp["prefill_s_min"] / base["prefill_s_min"],
            "prefill_time_median": comp["prefill_s_median"] / base["prefill_s_median"],
            "kv_bytes": comp["kv_bytes"] / base["kv_bytes"],
            "kv_bytes_vision": comp["kv_bytes_vision"] / comp["kv_bytes_vision_baseline"],
            "flops_estimate": comp["flops_estimate"] / comp["flops_estimate_baseline"],
        }
        if "peak_bytes_above_model" in base:
            entry["ratios"]["peak_memory"] = comp["peak_bytes_above_model"] / max(
                1, base["peak_bytes_above_model"]
            )
        results["shapes"][shape] = entry
        print(
            f"{shape}: {entry['prompt_tokens']} prompt tokens, ratios "
            f"{json.dumps(entry['ratios'])}",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


def _forward_args(args) -> list[str]:
    return [
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--intermediate",
        str(args.intermediate),
        "--heads",
        str(args.heads),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]


if __name__ == "__main__":
    raise SystemExit(main())
