"""What proportional attention costs on each kernel (issue 49): `lightkv-cover` at 22 / 11 /
5% kept on the LLaVA-1.5 shape (32 layers at full 7B width, bf16, a left-padded batch of 8
rows of one or two 576-token images), on every kernel the machine has, against the same
kept tokens without the bias and against the uncompressed model on that kernel:

* ``sdpa``: the bias on the 4-D mask (``mask`` route) and through the extra head channel
  (``channel`` route, no 4-D bias);
* ``flash_attention_2`` (where ``flash_attn`` imports): the channel route (head dim 129,
  padded to 136 in the kernel), the cache holding ``K'`` and ``V'``;
* ``flex_attention`` (on CUDA): FlexAttention's ``score_mod``, compiled.

Per variant: time to first token (prefill + the greedy first token, CUDA events, median of
``--repeats``), decoding ms per token (greedy, ``--decode-steps`` tokens, the TTFT taken
off), KV bytes, the attention kernels that ran, and whether its tokens equal the sdpa mask
route's (greedy; bf16 may flip a near tie).

    python benchmarks/bias_routes.py --out benchmarks/results/gpu/bias-routes   # on a GPU
    python benchmarks/bias_routes.py --dry-run     # CPU, sdpa, a tiny decoder: checks the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
from lightkv_lab.bench.efficiency import BenchConfig
from lightkv_lab.bench.efficiency.measure import Timer, first_token
from lightkv_lab.bench.efficiency.shapes import MODELS, build_model, scaled_pipeline

from lightkv.adapters import apply, kv_bytes
from lightkv.adapters.attention import AttentionWatch

sys.path.insert(0, str(Path(__file__).parent))
from flash_batch import padded_batch  # noqa: E402

KEPT = (0.22, 0.11, 0.05)


def kernels(dry_run: bool) -> list[str]:
    """The attention implementations this machine runs."""
    out = ["sdpa"]
    if dry_run or not torch.cuda.is_available():
        return out
    try:
        import flash_attn  # noqa: F401

        out.append("flash_attention_2")
    except ImportError:
        pass
    return out + ["flex_attention"]


def variants(spec, layers: int, kept, kernel: str) -> dict:
    """``name -> (pipeline or None, proportional_route)`` for one kernel."""
    out = {"uncompressed": (None, "auto")}
    for f in kept:
        cover = scaled_pipeline(f"lightkv-cover@{f}", spec, layers)
        out[f"cover@{f}"] = (cover, "auto")
        if kernel == "sdpa":
            out[f"cover@{f} channel"] = (cover, "channel")
        out[f"cover@{f} no bias"] = (replace(cover, proportional_attention=False), "auto")
    return out


def run_one(model, inputs, pipe, route, steps: int, repeats: int, warmup: int, device) -> dict:
    gen = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    ttft, total, ran, tokens, kv = [], [], None, None, None
    for i in range(warmup + repeats):
        with torch.no_grad():
            session = apply(pipe, model, proportional_route=route) if pipe is not None else None
            if session is not None:
                session.__enter__()
            try:
                if i == 0:
                    with AttentionWatch(model) as watch:
                        out, _ = first_token(model, inputs)
                    ran, kv = watch.implementations, kv_bytes(out.cache)
                with Timer(device) as t:
                    first_token(model, inputs)
                with Timer(device) as g:
                    seq = model.generate(**inputs, **gen)
            finally:
                if session is not None:
                    session.__exit__(None, None, None)
        if i >= warmup:
            ttft.append(t.seconds)
            total.append(g.seconds)
        tokens = seq[:, inputs["input_ids"].shape[1] :]
    first = statistics.median(ttft)
    return {
        "ttft_ms": 1000 * first,
        "decode_ms_per_token": 1000 * (statistics.median(total) - first) / max(steps - 1, 1),
        "ttft_ms_all": [1000 * s for s in ttft],
        "ran": ran,
        "kv_bytes": kv,
        "tokens": tokens.tolist(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, sdpa, a tiny decoder")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--kept-fractions", nargs="+", type=float, default=list(KEPT))
    ap.add_argument("--out", default=None, help="folder for bias-routes.json / .md")
    args = ap.parse_args(argv)
    spec = MODELS["llava"]
    if args.dry_run:
        cfg = BenchConfig(models=("llava",), layers=4, heads=1, device="cpu", dtype="float32")
        spec = replace(spec, build_kwargs={**spec.build_kwargs, "image_size": 16})
        repeats, warmup, steps, rows = 1, 0, 3, 2
    else:
        cfg = BenchConfig(
            models=("llava",), layers=args.layers, width="full", device="cuda", dtype="bfloat16"
        )
        repeats, warmup, steps, rows = args.repeats, 1, args.decode_steps, args.rows
    device = torch.device(cfg.device)
    model, _, sizes = build_model(spec, cfg, attn="sdpa")
    model.eval()
    inputs = padded_batch(model, rows, device, next(model.parameters()).dtype)
    results: dict[str, dict] = {}
    for kernel in kernels(args.dry_run):
        model.config._attn_implementation = kernel  # every sub-config; the same weights
        for name, (pipe, route) in variants(
            spec, sizes["layers"], args.kept_fractions, kernel
        ).items():
            results[f"{kernel} | {name}"] = run_one(
                model, inputs, pipe, route, steps, repeats, warmup, device
            )
            print(kernel, name, f"{results[f'{kernel} | {name}']['ttft_ms']:.1f} ms", flush=True)
    model.config._attn_implementation = "sdpa"
    for key, r in results.items():
        kernel, name = key.split(" | ")
        ref = results.get(f"sdpa | {name.replace(' channel', '')}")
        r["tokens_equal_sdpa_mask"] = ref is not None and r["tokens"] == ref["tokens"]
        base = results[f"{kernel} | uncompressed"]["ttft_ms"]
        r["ttft_vs_uncompressed"] = r["ttft_ms"] / base
    dry = " (dry run: timings meaningless)" if args.dry_run else ""
    title = (
        f"{spec.title}, {rows} padded rows, {cfg.dtype}, {sizes['layers']} layers of width "
        f"{sizes['hidden']}, {device.type}{dry}"
    )
    lines = [
        f"# lightkv-cover's bias per kernel: {title}",
        "",
        "| kernel | variant | TTFT ms | / uncompressed | decode ms/token | KV MiB | ran | "
        "tokens = sdpa mask route |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        kernel, name = key.split(" | ")
        lines.append(
            f"| {kernel} | {name} | {r['ttft_ms']:.1f} | {r['ttft_vs_uncompressed']:.3f} | "
            f"{r['decode_ms_per_token']:.2f} | {(r['kv_bytes'] or 0) / 2**20:.1f} | "
            f"{', '.join(r['ran'] or [])} | {'yes' if r['tokens_equal_sdpa_mask'] else 'no'} |"
        )
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"title": title, "dry_run": args.dry_run, "variants": results}
        (out / "bias-routes.json").write_text(json.dumps(doc, indent=1))
        (out / "bias-routes.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
