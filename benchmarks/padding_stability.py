"""Batch stability under left padding (issue 40 item 12): how often a row's compression
decisions and first-token log-probabilities change when the row runs inside a left-padded
batch instead of alone, on the bundled Scenes model, and where the difference enters.

For each method (its preset put at one kept fraction on the model's 12 layers, as the
benchmarks do) and each of ``--rows`` held-out Scenes questions, the row runs alone
(batch 1, no padding) and inside its batch of ``--batch`` rows (left-padded: questions
differ in length). Per row it records

* ``max_dlogp``: max over the vocabulary of |log p(first answer token)| alone vs batched;
* ``decisions_changed``: some stage's decisions differ (which tokens it keeps, drops, and
  what it merges into what), compared stage by stage on prompt positions;
* ``merge_input_diff``: max |difference| of the first stage's input hidden states (the
  output of the layer it works after, or the embeddings before the LLM), alone vs batched.

It also measures the uncompressed model alone vs batched, and, to find where the
difference enters, the uncompressed hidden states of one row at the first merge layer in
three settings against the row alone: a batch of two identical rows (batched matmuls, no
padding), the row alone but left-padded (a padding mask, batch 1), and the padded batch; and
one sdpa call of the model's shape with and without masked padding key columns.

    python benchmarks/padding_stability.py      # 100 rows, 5 methods, ~6 min on 2 cores
    python benchmarks/padding_stability.py --rows 20 --out /tmp/p.json

Writes ``benchmarks/results/padding-stability.json`` (atomically).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.tasks.model import BUNDLED_MODELS, load
from lightkv_lab.tasks.scenes import data as scenes

from lightkv.adapters import apply
from lightkv.outputs import write_atomic

METHODS = ("lightkv", "tome", "divprune", "lightkv-pre-llm", "lightkv-paper-released")
THRESHOLD = 1e-3


def episodes(n: int, seed: int, config):
    rng = random.Random(seed)
    return [scenes.make_episode(rng, split="heldout", config=config) for _ in range(n)]


def first_logp(logits: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` log-probabilities of the token after the prompt (the last column: the
    session keeps each row's last token in the last column)."""
    return torch.log_softmax(logits[:, -1].double(), dim=-1)


def stage_decisions(rec, row: int, pad: int) -> torch.Tensor:
    """``[N]`` one stage's decisions for ``row``: for each real token of its input, by prompt
    position (without padding), the prompt position of the token it is in after the stage
    (itself if kept, its destination if merged, -1 if dropped)."""
    valid = rec.layout.valid_mask[row]
    src = rec.layout.origin[row][valid] - pad
    to = rec.result.remap[row][valid]
    dest = torch.where(
        to >= 0, rec.result.layout.origin[row][to.clamp_min(0)] - pad, torch.full_like(to, -1)
    )
    order = src.argsort()
    return torch.stack([src[order], dest[order]])


def first_changed_stage(alone, batched, row: int, pad: int) -> int | None:
    """The first stage (index) whose decisions differ between the row alone and batched."""
    for k, (a, b) in enumerate(zip(alone, batched)):
        if not torch.equal(stage_decisions(a, 0, 0), stage_decisions(b, row, pad)):
            return k
    return None


def first_stage_input(session) -> torch.Tensor | None:
    recs = session.records
    return recs[0].hidden if recs else None


def run(model, batch, pipe):
    """``(logp [B, V], stage records, first stage input)``; ``pipe`` None: the model alone."""
    with torch.no_grad():
        if pipe is None:
            return first_logp(model(**batch).logits), None, None
        with apply(pipe, model, record=True) as session:
            out = model(**batch)
        return first_logp(out.logits), session.records, first_stage_input(session)


def layer_output(model, batch, layer: int) -> torch.Tensor:
    """The uncompressed model's hidden states after decoder layer ``layer``."""
    with torch.no_grad():
        return model(**batch, output_hidden_states=True).hidden_states[layer + 1]


def where_it_enters(model, eps, n_img: int, layer: int) -> dict:
    """Uncompressed hidden states of row 0 after ``layer``: alone vs (a) two identical rows,
    (b) the row left-padded alone, (c) the padded batch (row 0 is the shorter one)."""
    by_len = sorted(eps, key=lambda e: len(e.question))
    short, long_ = by_len[0], by_len[-1]
    alone = scenes.collate_prompts([short], n_img)
    ref = layer_output(model, alone, layer)[0]
    n = ref.shape[0]
    twin = scenes.collate_prompts([short, short], n_img)
    both = scenes.collate_prompts([short, long_], n_img)
    pad = both["input_ids"].shape[1] - n
    padded = {k: v[:1] for k, v in both.items()}  # the short row with its padding, alone
    # the kernel alone: one sdpa call of this model's shape, the row's keys with and without
    # masked padding columns on the left (same queries, keys, values)
    cfg = model.config.text_config
    heads, dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim, generator=g) for _ in range(3))
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    explicit = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    mask = torch.eye(n + pad, dtype=torch.bool)
    mask[pad:, pad:] |= causal
    wide = lambda t: torch.cat([torch.zeros(1, heads, pad, dim), t], dim=2)  # noqa: E731
    padded_call = torch.nn.functional.scaled_dot_product_attention(
        wide(q), wide(k), wide(v), attn_mask=mask
    )[:, :, pad:]
    out = {
        "layer": layer,
        "sdpa_explicit_causal_mask_vs_is_causal": (explicit - plain).abs().max().item(),
        "sdpa_masked_padding_keys_vs_none": (padded_call - explicit).abs().max().item(),
        "padding_columns": pad,
        "two_identical_rows_no_padding": (layer_output(model, twin, layer)[0] - ref)
        .abs()
        .max()
        .item(),
        "row_left_padded_alone": (layer_output(model, padded, layer)[0, pad:] - ref)
        .abs()
        .max()
        .item(),
        "padded_batch": (layer_output(model, both, layer)[0, pad:] - ref).abs().max().item(),
    }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--kept-fraction", type=float, default=0.22)
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--seed", type=int, default=4012)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "results" / "padding-stability.json")
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    model, _, grid = load(BUNDLED_MODELS["scenes"])
    n_img = scenes.num_image_tokens(grid)
    depth = model.config.text_config.num_hidden_layers
    eps = episodes(args.rows, args.seed, grid)
    batches = [eps[i : i + args.batch] for i in range(0, len(eps), args.batch)]
    pipes = {"uncompressed": None}
    hows = {}
    for name in args.methods:
        pipes[name], hows[name] = knob_pipeline(name, depth, args.kept_fraction)
    results = {}
    for name, pipe in pipes.items():
        rows = []
        for group in batches:
            batch = scenes.collate_prompts(group, n_img)
            width = batch["input_ids"].shape[1]
            lp_b, tr_b, h_b = run(model, batch, pipe)
            for i, ep in enumerate(group):
                single = scenes.collate_prompts([ep], n_img)
                pad = width - single["input_ids"].shape[1]
                lp_a, tr_a, h_a = run(model, single, pipe)
                row = {
                    "max_dlogp": (lp_b[i] - lp_a[0]).abs().max().item(),
                    "argmax_same": int(lp_b[i].argmax()) == int(lp_a[0].argmax()),
                }
                if tr_a:
                    row["first_changed_stage"] = first_changed_stage(tr_a, tr_b, i, pad)
                    row["decisions_changed"] = row["first_changed_stage"] is not None
                if h_a is not None:
                    row["merge_input_diff"] = (h_b[i, pad:] - h_a[0]).abs().max().item()
                rows.append(row)
        d = [r["max_dlogp"] for r in rows]
        entry = {
            "how": hows.get(name, "none"),
            "rows": len(rows),
            f"rows_dlogp_above_{THRESHOLD:g}": sum(x > THRESHOLD for x in d),
            "rate_dlogp_above_threshold": sum(x > THRESHOLD for x in d) / len(rows),
            "max_dlogp": max(d),
            "median_dlogp": sorted(d)[len(d) // 2],
            "argmax_changed": sum(not r["argmax_same"] for r in rows),
        }
        if rows and "decisions_changed" in rows[0]:
            changed = [r for r in rows if r["decisions_changed"]]
            entry["decisions_changed"] = len(changed)
            entry["rate_decisions_changed"] = len(changed) / len(rows)
            entry["dlogp_above_threshold_with_same_decisions"] = sum(
                r["max_dlogp"] > THRESHOLD for r in rows if not r["decisions_changed"]
            )
            entry["max_dlogp_with_same_decisions"] = max(
                (r["max_dlogp"] for r in rows if not r["decisions_changed"]), default=None
            )
            entry["dlogp_above_threshold_with_changed_decisions"] = sum(
                r["max_dlogp"] > THRESHOLD for r in changed
            )
            entry["first_changed_stage"] = sorted(r["first_changed_stage"] for r in changed)
        if rows and "merge_input_diff" in rows[0]:
            entry["max_merge_input_diff"] = max(r["merge_input_diff"] for r in rows)
        results[name] = entry
        print(
            f"{name:24s} {entry['rate_dlogp_above_threshold']:.2f} of rows > {THRESHOLD:g} (max "
            f"{entry['max_dlogp']:.3g}); decisions changed: {entry.get('decisions_changed', '-')}",
            flush=True,
        )
    first = (
        min((s.spec.layer for s in pipes["lightkv"].stages(depth)), default=0)
        if "lightkv" in pipes
        else 0
    )
    enters = where_it_enters(model, eps, n_img, first)
    print("where it enters:", enters, flush=True)
    doc = {
        "what": "batch stability under left padding, Scenes model (issue 40 item 12)",
        "command": "python benchmarks/padding_stability.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "model": "scenes (bundled, LLaVA, 12 layers, float32, sdpa)",
        "rows": args.rows,
        "batch": args.batch,
        "kept_fraction": args.kept_fraction,
        "seed": args.seed,
        "threshold_nats": THRESHOLD,
        "torch": torch.__version__,
        "threads": args.threads,
        "methods": results,
        "where_it_enters": enters,
        "seconds": round(time.time() - t0, 1),
    }
    write_atomic(args.out, json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out} ({doc['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
