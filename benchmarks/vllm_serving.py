"""Serving throughput and time to first token: stock vLLM vs lightkv's vLLM plugin.

A random-weight Qwen2.5-VL of the 7B shape (28 layers of width 3584, the 32-block vision
tower; vLLM's ``load_format="dummy"``, so nothing is downloaded and no weights are written)
serves the same batch of image prompts three times, each engine in a subprocess of its own:
stock ``Qwen2_5_VLForConditionalGeneration``, then ``LightKVQwen2_5_VLForConditionalGeneration``
with ``divprune`` (22% of each image's tokens kept) and with LightKV's windowed merging
before the LLM (``pre_llm``, ratio 0.5, uniform relevance). At equal batch it measures:

- time to first token: the batch's wall time with ``max_tokens=1`` (prefill, vision encoder
  included), and per request ``first_token_latency`` where vLLM reports it;
- throughput: generated tokens per second over the batch with ``max_tokens`` (greedy,
  ``ignore_eos``), and requests per second;
- the prompt length vLLM scheduled (the image placeholders after compression).

    # needs vLLM 0.32.x or 0.33.x and a GPU
    python benchmarks/vllm_serving.py --out benchmarks/results/gpu
    # checks the set-up, no vLLM needed
    python benchmarks/vllm_serving.py --dry-run

``benchmarks/gpu_check.sh`` runs it with ``GPU_CHECK_VLLM=1``. Writes ``vllm-serving.json``
and ``vllm-serving.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightkv.outputs import write_atomic

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
WORDS = 1000
SHAPE_7B = dict(
    text=dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [16, 24, 24],
        },
    ),
    vision=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        out_hidden_size=3584,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
)
VARIANTS = {
    "stock": None,
    "divprune": "divprune",
    "lightkv-pre-llm-uniform": {
        "name": "lightkv-pre-llm-uniform",
        "schedule": {"name": "pre_llm", "params": {"removal_ratio": 0.5, "windows_per_side": 4}},
        "partitioner": "grid",
        "scorer": "cosine",
        "pruner": "divergence",
        "passer": "relevance_mean",
        "relevance": "uniform",
    },
}


def build_model_dir(
    out: Path,
    shape: dict = SHAPE_7B,
    dtype: str = "bfloat16",
    max_patches: int = 16384,
    architecture: str | None = None,
) -> Path:
    """Config, tokenizer (word level, made with `tokenizers`) and image processor of a
    Qwen2.5-VL of ``shape`` (``text`` and ``vision`` configs; default 7B-shaped); no weights
    (vLLM's dummy loader makes random ones). ``max_patches``: the image processor's largest
    image, in 28 x 28 patches; ``architecture``: written into the config when given (stock
    vLLM resolves the model class from it). `vllm_concurrency.py` builds its models here too.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig

    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(WORDS)} | {t: WORDS + i for i, t in enumerate(SPECIAL)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
    ).save_pretrained(out)
    cfg = Qwen2_5_VLConfig(
        text_config=shape["text"],
        vision_config=shape["vision"],
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|endoftext|>"],
        torch_dtype=dtype,
    )
    if architecture is not None:
        cfg.architectures = [architecture]
    cfg.save_pretrained(out)
    factor = 28
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor",
                "patch_size": 14,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "min_pixels": 4 * factor * factor,
                "max_pixels": max_patches * factor * factor,
                "size": {
                    "shortest_edge": 4 * factor * factor,
                    "longest_edge": max_patches * factor * factor,
                },
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
            }
        )
    )
    return out


def serve(args: argparse.Namespace, variant: str) -> dict:
    """Run one engine (this process) on the batch; return its measurements."""
    import numpy as np
    from PIL import Image
    from vllm import LLM, SamplingParams

    pipeline = VARIANTS[variant]
    overrides = (
        None
        if pipeline is None
        else {"architectures": ["LightKVQwen2_5_VLForConditionalGeneration"], "lightkv": pipeline}
    )
    llm = LLM(
        model=args.model_dir,
        tokenizer=args.model_dir,
        load_format="dummy",
        dtype="bfloat16",
        hf_overrides=overrides,
        enforce_eager=args.eager,
        max_model_len=8192,
        max_num_seqs=args.batch,
        limit_mm_per_prompt={"image": 1},
        gpu_memory_utilization=0.85,
        seed=0,
        enable_prefix_caching=False,
    )
    rng = np.random.default_rng(0)
    px = args.image_tokens_side * 28
    prompts = []
    for _ in range(args.batch):
        words = " ".join(f"w{j}" for j in rng.integers(0, WORDS, 32))
        image = Image.fromarray(rng.integers(0, 256, (px, px, 3), dtype=np.uint8))
        prompts.append(
            {
                "prompt": f"{words} <|vision_start|> <|image_pad|> <|vision_end|> {words}",
                "multi_modal_data": {"image": image},
            }
        )
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], first, use_tqdm=False)  # warm-up
    out: dict = {"variant": variant, "pipeline": pipeline}
    t0 = time.perf_counter()
    res = llm.generate(prompts, first, use_tqdm=False)
    out["batch_ttft_s"] = time.perf_counter() - t0
    latencies = [
        getattr(r.metrics, "first_token_latency", None) for r in res if r.metrics is not None
    ]
    out["mean_first_token_latency_s"] = (
        (sum(latencies) / len(latencies)) if latencies and None not in latencies else None
    )
    out["prompt_len"] = len(res[0].prompt_token_ids)
    t0 = time.perf_counter()
    res = llm.generate(prompts, full, use_tqdm=False)
    wall = time.perf_counter() - t0
    generated = sum(len(r.outputs[0].token_ids) for r in res)
    out.update(
        generate_s=wall, output_tokens_per_s=generated / wall, requests_per_s=len(res) / wall
    )
    return out


def report(results: list[dict], args: argparse.Namespace) -> str:
    """A markdown table, stock first, with ratios against stock."""
    base = results[0]
    lines = [
        f"Qwen2.5-VL 7B shape (random weights, bf16), batch {args.batch}, one "
        f"{args.image_tokens_side}x{args.image_tokens_side}-token image per prompt, "
        f"{args.max_tokens} new tokens.",
        "",
        "| variant | prompt tokens | batch TTFT (s) | x stock | output tok/s | x stock |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:80]} | | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {r['prompt_len']} | {r['batch_ttft_s']:.3f} | "
            f"{r['batch_ttft_s'] / base['batch_ttft_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
            f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Parse arguments; with ``--variant`` serve one engine, else run every variant in a
    subprocess."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results/gpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument(
        "--image-tokens-side", type=int, default=24, help="image side in tokens after the 2x2 merge"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--eager", action="store_true", help="enforce_eager (faster start, slower decoding)"
    )
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the model directory and check the plan; no vLLM",
    )
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        write_atomic(Path(args.result), json.dumps(serve(args, args.variant)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(Path(tmp) / "qwen2_5_vl-7b-shape")
        if args.dry_run:
            from lightkv.integrations.vllm.plan import PreLLMPlan

            side = args.image_tokens_side
            for name, spec in VARIANTS.items():
                kept = (
                    side * side
                    if spec is None
                    else PreLLMPlan.load(spec, SHAPE_7B["text"]["num_hidden_layers"]).kept_count(
                        side, side
                    )
                )
                print(
                    f"vllm_serving (dry run): {name}: {kept} of {side * side} image tokens; model "
                    f"dir {sorted(f.name for f in model_dir.iterdir())}"
                )
            return 0
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
                "--batch",
                str(args.batch),
                "--image-tokens-side",
                str(args.image_tokens_side),
                "--max-tokens",
                str(args.max_tokens),
            ] + (["--eager"] if args.eager else [])
            env = {
                **os.environ,
                "VLLM_USE_V2_MODEL_RUNNER": "0",
            }  # the plugin's pruning path is the V1 runner's
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            results.append(
                json.loads(res.read_text())
                if res.exists()
                else {"variant": variant, "error": proc.stderr[-2000:]}
            )
            print(json.dumps(results[-1])[:400], flush=True)
    write_atomic(
        out / "vllm-serving.json", json.dumps({"batch": args.batch, "results": results}, indent=1)
    )
    write_atomic(out / "vllm-serving.md", report(results, args))
    print(report(results, args))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
