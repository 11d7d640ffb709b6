"""Stock FlashAttention-2 against lightkv under FlashAttention-2 on a padded batch: the
LLaVA-1.5 shape (32 layers at full 7B width on a GPU), 8 left-padded rows of unequal images
(rows of one and of two 576-token images, text of different lengths), each preset at 55 / 22
/ 11% kept; time to first token from CUDA events (prefill + the greedy first token), the
attention each variant ran (all must run the stock model's), the tokens kept per row.

    python benchmarks/flash_batch.py --out benchmarks/results/gpu/flash-batch   # CUDA + flash_attn
    python benchmarks/flash_batch.py --dry-run                                  # CPU, sdpa, tiny

``--dry-run`` checks the script on a CPU (sdpa, 6 layers of one 128-wide head, float32, 64-token
images, one timed prefill): the same batch shape, variants and checks, timings meaningless.
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch
from lightkv_lab.bench.efficiency import BenchConfig
from lightkv_lab.bench.efficiency.measure import Timer, first_token
from lightkv_lab.bench.efficiency.shapes import (
    MODELS,
    POST_TEXT,
    PRE_TEXT,
    build_model,
    scaled_pipeline,
)
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply
from lightkv.adapters.attention import AttentionWatch, check_same_attention

PRESETS = ("lightkv", "divprune", "lightkv-low-budget")
KEPT = (0.55, 0.22, 0.11)


def padded_batch(model, rows: int, device, dtype) -> dict:
    """``rows`` left-padded rows of the LLaVA-1.5 shape: one image on even rows, two on odd
    ones, text before them of different lengths (unequal rows, so every row is padded)."""
    fam = TINY_MODELS["llava"]
    batch = fam.collate(
        [
            fam.row(model, 1 + i % 2, pre=PRE_TEXT + 3 * i, post=POST_TEXT, seed=i)
            for i in range(rows)
        ]
    )
    return {
        k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in batch.items()
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU, sdpa, a tiny decoder: checks the script"
    )
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--kept-fractions", nargs="+", type=float, default=list(KEPT))
    ap.add_argument("--out", default=None, help="folder for flash-batch.json / .md")
    args = ap.parse_args(argv)
    if args.dry_run:
        cfg = BenchConfig(
            models=("llava",),
            layers=6,
            heads=1,
            device="cpu",
            dtype="float32",
            memory=False,
            eager_reference=False,
            attn_implementation="sdpa",
        )
        repeats, warmup = 1, 0
    else:
        cfg = BenchConfig(
            models=("llava",),
            layers=args.layers,
            width="full",
            device="cuda",
            dtype="bfloat16",
            memory=False,
            eager_reference=False,
            attn_implementation="flash_attention_2",
        )
        repeats, warmup = args.repeats, 1
    spec = MODELS["llava"]
    if args.dry_run:  # 8x8 patches per image instead of 24x24: the same code paths in seconds
        spec = replace(spec, build_kwargs={**spec.build_kwargs, "image_size": 16})
    device = torch.device(cfg.device)
    model, _, sizes = build_model(spec, cfg)
    inputs = padded_batch(model, args.rows, device, next(model.parameters()).dtype)
    variants = {"uncompressed": None}
    variants.update(
        {
            f"{p}@{f}": scaled_pipeline(f"{p}@{f}", spec, sizes["layers"])
            for p in args.presets
            for f in args.kept_fractions
        }
    )
    times: dict[str, list[float]] = {v: [] for v in variants}
    ran, kept = {}, {}
    with torch.no_grad():
        for i in range(warmup + repeats):
            for name, pipe in variants.items():
                with ExitStack() as stack:
                    session = stack.enter_context(apply(pipe, model)) if pipe is not None else None
                    watch = (
                        stack.enter_context(AttentionWatch(model)) if i == 0 else None
                    )  # untimed: warm-up
                    with Timer(device) as t:
                        first_token(model, inputs)
                if watch is not None:
                    ran[name] = watch.implementations
                if session is not None and session.last_prefill is not None:
                    layout = session.last_prefill.final_layout
                    kept[name] = layout.valid_mask.sum(1).tolist() if layout is not None else None
                if i >= warmup:
                    times[name].append(t.seconds)
    check_same_attention(
        ran, "uncompressed"
    )  # a compressed run on another kernel would not compare
    base = statistics.median(times["uncompressed"])
    result = {
        "model": spec.title,
        "rows": args.rows,
        "layers": sizes["layers"],
        "width": sizes["hidden"],
        "device": cfg.device,
        "dtype": cfg.dtype,
        "attention": cfg.attn_implementation,
        "dry_run": args.dry_run,
        "prompt_tokens_per_row": inputs["attention_mask"].sum(1).tolist(),
        "variants": {
            v: {
                "ttft_ms": 1000 * statistics.median(ts),
                "ttft_ms_all": [1000 * s for s in ts],
                "vs_uncompressed": statistics.median(ts) / base,
                "ran": ran[v],
                "kept_per_row": kept.get(v),
            }
            for v, ts in times.items()
        },
    }
    lines = [
        f"# {spec.title}, {args.rows} padded rows, {cfg.attn_implementation}, {cfg.dtype}, "
        f"{sizes['layers']} layers of width {sizes['hidden']}",
        "",
        "| variant | TTFT ms (median) | / uncompressed | ran | tokens per row |",
        "|---|---|---|---|---|",
    ]
    for v, r in result["variants"].items():
        lines.append(
            f"| {v} | {r['ttft_ms']:.1f} | {r['vs_uncompressed']:.3f} | {', '.join(r['ran'])} | "
            f"{r['kept_per_row'] or result['prompt_tokens_per_row']} |"
        )
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "flash-batch.json").write_text(json.dumps(result, indent=1))
        (out / "flash-batch.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
