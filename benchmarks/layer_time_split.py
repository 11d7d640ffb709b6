"""Where a full-width decoder layer's prefill time goes, at several sequence lengths: the
attention kernel (sdpa, causal) against everything else (projections, MLP, norms), each as
time and as FLOP rate. It explains why a compressed prefill's TTFT ratio need not equal
its FLOPs ratio: the analytic count prices a FLOP of attention like a FLOP of a matrix
product, and the two kernels run at different rates, which change with the length.

* ``layer``: a LLaMA decoder layer (LLaVA-NeXT-7B's Vicuna: 4096 wide, 32 heads, MLP 11008)
  on ``N`` tokens with sdpa and no mask (``is_causal``: the uncompressed prefill's case);
* ``attention``: the layer's sdpa call alone on the same shapes, causal without a mask and
  with an explicit boolean mask (what a compressed layer's 4-D mask costs the kernel);
* FLOPs as `lightkv.adapters.probes.LayerShape.flops` counts them (attention at the causal
  half, 2 FLOPs per multiply-add).

    python benchmarks/layer_time_split.py --tokens 320 640 1600 2970 --repeats 3 --threads 2 \
        --out benchmarks/results/layer-time-split.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lightkv.adapters.probes import LayerShape
from lightkv.outputs import write_atomic

HIDDEN, HEADS, HEAD_DIM, MLP = 4096, 32, 128, 11008


def _best(fn, repeats: int) -> tuple[float, float]:
    fn()  # warm-up: allocator, thread pool
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def measure(n: int, repeats: int) -> dict:
    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        intermediate_size=MLP,
        num_hidden_layers=1,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0).eval()
    rope = LlamaRotaryEmbedding(cfg)
    x = torch.randn(1, n, HIDDEN)
    pos = rope(x, torch.arange(n)[None])
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM) for _ in range(3))
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        layer_t = _best(lambda: layer(x, attention_mask=None, position_embeddings=pos), repeats)
        causal_t = _best(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
            repeats,
        )
        masked_t = _best(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            repeats,
        )
    shape = LayerShape(
        hidden=HIDDEN,
        heads=HEADS,
        kv_heads=HEADS,
        head_dim=HEAD_DIM,
        mlp_hidden=MLP,
        mlp_matrices=3,
    )
    total = shape.flops(n, (n + 1) / 2)
    attn = 2 * 2 * n * (n + 1) / 2 * HEADS * HEAD_DIM
    rest_t = layer_t[0] - causal_t[0]
    return {
        "tokens": n,
        "layer_s": layer_t[0],
        "layer_s_median": layer_t[1],
        "attention_causal_s": causal_t[0],
        "attention_masked_s": masked_t[0],
        "attention_share_of_time": causal_t[0] / layer_t[0],
        "attention_share_of_flops": attn / total,
        "gflops_per_s_attention": attn / causal_t[0] / 1e9,
        "gflops_per_s_rest": (total - attn) / rest_t / 1e9,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[320, 640, 1600, 2970])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [measure(n, args.repeats) for n in args.tokens]
    for r in rows:
        print(
            f"N={r['tokens']:5d}: layer {r['layer_s']:.3f} s, attention "
            f"{r['attention_causal_s']:.3f} s (masked {r['attention_masked_s']:.3f} s), attention "
            f"{r['attention_share_of_time']:.1%} of the time vs "
            f"{r['attention_share_of_flops']:.1%} of the FLOPs; GFLOP/s attention "
            f"{r['gflops_per_s_attention']:.0f}, rest {r['gflops_per_s_rest']:.0f}"
        )
    if args.out:
        write_atomic(
            args.out,
            json.dumps(
                {
                    "command": "python benchmarks/layer_time_split.py "
                    + " ".join(sys.argv[1:] if argv is None else argv),
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "rows": rows,
                },
                indent=1,
            ),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
