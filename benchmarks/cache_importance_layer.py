"""One full-width decoder layer's prefill against the cache presets' importance scoring at
that layer, interleaved, minimum and median of several runs: a per-layer view of what
ElasticCache and H2O add to the prefill, steadier than whole-model TTFT on a shared machine.

* ``layer``: a LLaMA decoder layer (LLaVA-NeXT-7B's Vicuna: 4096 wide, 32 heads, MLP 11008)
  on ``N`` tokens with sdpa, as in the model;
* ``tapped``: the scoring now (queries and keys finished from the layer's own projection
  outputs, `accumulated_attention` over the causal key columns);
* ``second_projection``: the scoring before (the layer's input normed and projected again,
  every query chunk against every key column).

    python benchmarks/cache_importance_layer.py --tokens 2970 --repeats 5 --out benchmarks/results/cache-importance/layer.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lightkv.adapters.probes import probe_for_layer
from lightkv.policies.cache_policies import accumulated_attention
from lightkv.policies.relevance import _accumulator, _match_heads


def full_chunked(queries, keys, valid, origin, scale, chunk=256):
    """The scoring as it was before: every query chunk against every key column."""
    b, h, n, _ = queries.shape
    acc = _accumulator(queries)
    k = _match_heads(keys, h).to(acc)
    out = torch.zeros(b, n, dtype=acc)
    for start in range(0, n, chunk):
        q = queries[:, :, start:start + chunk].to(acc)
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale
        allowed = (origin.unsqueeze(1) <= origin[:, start:start + chunk].unsqueeze(2)) & valid.unsqueeze(1)
        allowed &= valid[:, start:start + chunk].unsqueeze(2)
        logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        out += torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=(1, 2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2970)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                      attn_implementation="sdpa")
    layer = LlamaDecoderLayer(cfg, 0).eval()
    n = args.tokens
    hidden = torch.randn(1, n, 4096)
    pos_ids = torch.arange(n)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(hidden, pos_ids)
    probe = probe_for_layer(layer)
    valid, origin = torch.ones(1, n, dtype=torch.bool), pos_ids.clone()
    scale = 1.0 / math.sqrt(probe.head_dim)
    with torch.no_grad():
        x = probe.normed(hidden)
        raw = probe.project(x)  # what the layer computes anyway (the tap reads it)

        def run_layer():
            layer(hidden, attention_mask=None, position_ids=pos_ids, position_embeddings=(cos, sin))

        def tapped():
            accumulated_attention(probe.queries_from(raw, cos, sin), probe.keys_from(raw, cos, sin), valid, origin,
                                  scale)

        def second_projection():
            xn = probe.normed(hidden)
            full_chunked(probe.queries(xn, cos, sin), probe.keys(xn, cos, sin), valid, origin, scale)

        runs = {"layer": run_layer, "tapped": tapped, "second_projection": second_projection}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for f in runs.values():  # warm-up
            f()
        for _ in range(args.repeats):
            for name, f in runs.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
    res = {"tokens": n, "threads": torch.get_num_threads(), "repeats": args.repeats,
           "seconds": {k: {"min": min(v), "median": statistics.median(v), "all": v} for k, v in times.items()}}
    for stat in ("min", "median"):
        base = res["seconds"]["layer"][stat]
        res[f"layer_ratio_{stat}"] = {k: (base + res["seconds"][k][stat]) / base for k in ("tapped", "second_projection")}
    print(json.dumps({k: v for k, v in res.items() if k != "seconds"}, indent=1))
    for k, v in res["seconds"].items():
        print(f"{k}: min {v['min']:.2f} s, median {v['median']:.2f} s")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
