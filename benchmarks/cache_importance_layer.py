"""One full-width decoder layer's prefill against the cache presets' importance scoring at
that layer, interleaved, minimum and median of several runs: a per-layer view of what
ElasticCache and H2O add to the prefill, steadier than whole-model TTFT on a shared machine.

* ``layer``: a LLaMA decoder layer (LLaVA-NeXT-7B's Vicuna: 4096 wide, 32 heads, MLP 11008)
  on ``N`` tokens with sdpa, as in the model;
* ``tapped``: the scoring now (queries and keys finished from the layer's own projection
  outputs, `accumulated_attention` over the causal key columns, in cache-sized blocks);
* ``tapped_unblocked``: the same before the blocks (`unblocked_chunked`: every head of a
  chunk at once, two chunk-sized buffers, float32 sums: `accumulated_attention` as at 299b858);
* ``merge``: ElasticCache's merge of that layer's cache (`CacheStage` of the preset's stage:
  anchors by the scores, every other vision entry into its nearest anchor);
* ``second_projection`` (with ``--second-projection``): the scoring before the tap (the
  layer's input normed and projected again, every query chunk against every key column).

    python benchmarks/cache_importance_layer.py --tokens 2970 --repeats 3 --threads 2 \
        --out benchmarks/results/cache-importance/layer.json

``--allocator system`` times with glibc's defaults (fresh pages for every large block).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from lightkv_lab.bench.allocator import ALLOCATORS, host_allocator
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lightkv.adapters.masks import drop_padding
from lightkv.adapters.probes import probe_for_layer
from lightkv.cache_stage import CacheStage
from lightkv.graph.layout import ImageSegment, VisionLayout
from lightkv.methods.cache_policies import accumulated_attention, causal_chunks
from lightkv.outputs import write_atomic
from lightkv.policies.relevance import _accumulator, _match_heads
from lightkv.presets import get_preset_config


def full_chunked(queries, keys, valid, origin, scale, chunk=256):
    """The scoring as it was before: every query chunk against every key column."""
    b, h, n, _ = queries.shape
    acc = _accumulator(queries)
    k = _match_heads(keys, h).to(acc)
    out = torch.zeros(b, n, dtype=acc)
    for start in range(0, n, chunk):
        q = queries[:, :, start : start + chunk].to(acc)
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale
        allowed = (
            origin.unsqueeze(1) <= origin[:, start : start + chunk].unsqueeze(2)
        ) & valid.unsqueeze(1)
        allowed &= valid[:, start : start + chunk].unsqueeze(2)
        logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        out += torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=(1, 2))
    return out


def unblocked_chunked(queries, keys, valid, origin, scale, chunk=256):
    """The tapped scoring before the blocks: each chunk of every head at once into two
    chunk-sized buffers, the logits scaled after the product, float32 sums."""
    b, h, n, _ = queries.shape
    acc = _accumulator(queries)
    k = _match_heads(keys, h).to(acc)
    out = torch.zeros(b, n, dtype=acc)
    key_at = origin.masked_fill(~valid, torch.iinfo(origin.dtype).max)
    query_at = origin.masked_fill(~valid, -1)
    plan = causal_chunks(valid, origin, chunk)
    size = b * h * min(chunk, n) * max((end for end, _, _ in plan), default=0)
    logits_buf, attn_buf = torch.empty(size, dtype=acc), torch.empty(size, dtype=acc)
    k_t = k.transpose(-1, -2)
    for start, (end, lo, holes) in zip(range(0, n, chunk), plan):
        if end == 0:
            continue
        q = queries[:, :, start : start + chunk].to(acc)
        shape = (b, h, q.shape[2], end)
        used = math.prod(shape)
        logits = torch.matmul(q, k_t[..., :end], out=logits_buf[:used].view(shape)).mul_(scale)
        if lo < end:
            blocked = key_at[:, None, lo:end] > query_at[:, start : start + chunk, None]
            logits[..., lo:end].masked_fill_(blocked.unsqueeze(1), float("-inf"))
        attn = torch.ops.aten._softmax.out(logits, -1, False, out=attn_buf[:used].view(shape))
        if holes:
            attn.masked_fill_(~valid[:, None, start : start + chunk, None], 0.0)
        out[:, :end] += attn.sum(dim=(1, 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2970)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--second-projection", action="store_true", help="also time the scoring before the tap"
    )
    ap.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default="steady",
        help="host memory (lightkv_lab.bench.allocator; default steady, as the efficiency "
        "benchmark)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with host_allocator(args.allocator) as heap:
        res = measure(args)
    res["allocator"] = heap
    print(json.dumps({k: v for k, v in res.items() if k != "seconds"}, indent=1))
    for k, v in res["seconds"].items():
        print(f"{k}: min {v['min']:.2f} s, median {v['median']:.2f} s")
    if args.out:
        write_atomic(args.out, json.dumps(res, indent=1))


def measure(args) -> dict:
    """Time the layer and the scorings (see the module docstring)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        attn_implementation="sdpa",
    )
    layer = LlamaDecoderLayer(cfg, 0).eval()
    n = args.tokens
    hidden = torch.randn(1, n, 4096)
    pos_ids = torch.arange(n)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(hidden, pos_ids)
    probe = probe_for_layer(layer)
    valid, origin = torch.ones(1, n, dtype=torch.bool), pos_ids.clone()
    # LLaVA-NeXT's anyres prompt: the base image and the tiles (2,928 tokens at 2,970)
    base = 24 if n >= 600 + 24 * 24 else 2
    layout = VisionLayout.from_segments(
        1,
        n,
        [
            ImageSegment(row=0, offset=20, grid=(base, base)),
            ImageSegment(row=0, offset=20 + base * base, grid=((n - 42 - base * base) // 48, 48)),
        ],
    )
    stage = get_preset_config("elasticcache").build().stages(1)[0]
    scale = 1.0 / math.sqrt(probe.head_dim)
    with torch.no_grad():
        x = probe.normed(hidden)
        raw = probe.project(x)  # what the layer computes anyway (the tap reads it)

        def run_layer():
            layer(hidden, attention_mask=None, position_ids=pos_ids, position_embeddings=(cos, sin))

        def tapped():
            return accumulated_attention(
                probe.queries_from(raw, cos, sin),
                probe.keys_from(raw, cos, sin),
                valid,
                origin,
                scale,
            )

        def tapped_unblocked():
            return unblocked_chunked(
                probe.queries_from(raw, cos, sin),
                probe.keys_from(raw, cos, sin),
                valid,
                origin,
                scale,
            )

        xi = torch.where(layout.vision_mask, tapped(), 0.0)
        cache_k, cache_v = (
            probe.keys_from(raw, cos, sin),
            probe.keys_from(raw, None, None),
        )  # values' shape

        def merge():
            CacheStage(stage)(cache_k, cache_v, layout, xi, None, finish=drop_padding)

        def second_projection():
            xn = probe.normed(hidden)
            full_chunked(
                probe.queries(xn, cos, sin), probe.keys(xn, cos, sin), valid, origin, scale
            )

        runs = {
            "layer": run_layer,
            "tapped": tapped,
            "tapped_unblocked": tapped_unblocked,
            "merge": merge,
        }
        if args.second_projection:
            runs["second_projection"] = second_projection
        times: dict[str, list[float]] = {k: [] for k in runs}
        for f in runs.values():  # warm-up
            f()
        for _ in range(args.repeats):
            for name, f in runs.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
    res = {
        "tokens": n,
        "vision_tokens": int(layout.vision_mask.sum()),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "seconds": {
            k: {"min": min(v), "median": statistics.median(v), "all": v} for k, v in times.items()
        },
    }
    for stat in ("min", "median"):
        base = res["seconds"]["layer"][stat]
        res[f"layer_ratio_{stat}"] = {
            k: (base + res["seconds"][k][stat]) / base for k in runs if k != "layer"
        }
        res[f"layer_ratio_{stat}"]["elasticcache"] = (
            base + res["seconds"]["tapped"][stat] + res["seconds"]["merge"][stat]
        ) / base
    return res


if __name__ == "__main__":
    main()
