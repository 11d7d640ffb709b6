"""Peak memory and time of a non-bilinear edge scorer, before and after chunking (issue 25).

A researcher's Jensen-Shannon divergence between the per-head key distributions of two
tokens (softmax over each head's 128 key dimensions) builds ``[K, a, b, H, d]``
intermediates. At LLaVA-NeXT width (32 key heads x 128 dimensions, fp32) in one global
window of 2,928 tokens (a 24x24 base grid, a 48x48 high-resolution grid and its 48 row
newlines, all in the window; parity split: 1,464 x 1,464 pairs) one such intermediate is
35 GB, so the unchunked call cannot run on this machine. This script

* measures the unchunked call (one `divergence` call, budget unlimited) where it fits, on
  global windows of 96, 144, 192 and 288 tokens, and fits peak bytes per pair;
* states the unchunked peak at 2,928 tokens as that fit's **estimate** (not measured);
* measures the chunked call (`EdgeScorer.best_edges` with the default 256 MiB budget,
  what a `Stage` does) at the full 2,928 tokens, and once more at 288 tokens to check
  that it returns exactly what the unchunked call does. At full width it runs on
  ``--fraction`` of the 1,464 source rows (default a quarter, ~2 minutes on 2 cores;
  ``--fraction 1`` for all): its chunks are the whole window's, so the peak is measured
  as is, and the time is scaled to the whole window (rows are independent).

Each measurement runs in a fresh process; peak memory is the process's peak resident set
(``ru_maxrss``) minus its resident set just before the call, so it counts every
intermediate the call allocates. Times are one run each (``--repeats`` for more), on the
CPU with torch's default threads.

Run ``python benchmarks/divergence_memory.py``; results go to
``benchmarks/results/divergence-memory.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lightkv.graph import BipartiteGraph
from lightkv.outputs import write_atomic
from lightkv.policies import EdgeScorer
from lightkv.policies.scorers import DEFAULT_DIVERGENCE_BYTES

HEADS, HEAD_DIM = 32, 128
FULL_TOKENS = 2928
SMALL = (96, 144, 192, 288)
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class KeyJS(EdgeScorer):
    """Jensen-Shannon divergence of per-head key softmaxes, averaged over heads:
    ``JS(p, q) = H((p + q) / 2) - (H(p) + H(q)) / 2``; only the mixture's entropy needs
    the pairs (three ``[K, a, b, H, d]`` intermediates)."""

    features: str = "key_states"
    pair_intermediates = 4  # m, its clamp, its log, their product

    def divergence(self, src, dst):
        p, q = src.softmax(-1), dst.softmax(-1)  # [K, a, H, d], [K, b, H, d]
        h_p = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [K, a, H]
        h_q = -(q * q.clamp_min(1e-30).log()).sum(-1)
        m = (p.unsqueeze(2) + q.unsqueeze(1)).mul_(0.5)  # [K, a, b, H, d]
        h_m = -(m * m.clamp_min(1e-30).log()).sum(-1)  # [K, a, b, H]
        return (h_m - (h_p.unsqueeze(2) + h_q.unsqueeze(1)) / 2).mean(-1)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(tokens: int, budget: int, repeats: int, fraction: float, out: str | None) -> None:
    """One measurement in this process: print a JSON line. ``fraction`` < 1 keeps only
    that share of the window's source rows (every destination stays): the chunks, so the
    peak, are those of the whole window, and the time is that share of its time."""
    g = torch.Generator().manual_seed(0)
    window = torch.zeros(1, tokens, dtype=torch.long)
    is_src = (torch.arange(tokens) % 2 == 0).unsqueeze(0)  # parity split
    rows = round((tokens - tokens // 2) * fraction)
    window[0, 2 * rows :: 2] = -1  # sources past the first rows leave the graph
    graph = BipartiteGraph.build(window, is_src)
    keys = torch.randn(tokens, HEADS, HEAD_DIM, generator=g)
    scorer = KeyJS()
    times = []
    before = _rss()
    for _ in range(repeats):
        start = time.perf_counter()
        dst, div = scorer.best_edges(graph, keys, budget=budget)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    if out:
        torch.save((dst, div), out)
    a = int(graph.src_count[0])
    b = int(graph.dst_count[0])
    print(
        json.dumps(
            {
                "tokens": tokens,
                "pairs": a * b,
                "source_fraction": fraction,
                "budget_bytes": budget,
                "peak_bytes": max(peak, 0),
                "seconds": min(times),
                "threads": torch.get_num_threads(),
            }
        )
    )


def _run(
    tokens: int, budget: int, repeats: int, out: str | None = None, fraction: float = 1.0
) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        str(tokens),
        str(budget),
        str(repeats),
        str(fraction),
    ]
    cmd += [out] if out else []
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--fraction",
        type=float,
        default=0.25,
        help="share of the 1,464 source rows timed at full width (1: all; the time is scaled)",
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tokens, budget, repeats = (int(v) for v in args.child[:3])
        child(
            tokens,
            budget,
            repeats,
            float(args.child[3]),
            args.child[4] if len(args.child) > 4 else None,
        )
        return
    unlimited = 2**62
    before = [_run(n, unlimited, args.repeats) for n in SMALL]
    per_pair = max(r["peak_bytes"] / r["pairs"] for r in before)  # the fit: peak grows with pairs
    full_pairs = (FULL_TOKENS // 2) * (FULL_TOKENS - FULL_TOKENS // 2)
    tmp = RESULTS / "_divergence_check"
    tmp.mkdir(parents=True, exist_ok=True)
    whole = _run(SMALL[-1], unlimited, 1, str(tmp / "whole.pt"))
    small_chunked = _run(
        SMALL[-1], 2**20, 1, str(tmp / "chunked.pt")
    )  # 1 MiB: many chunks at 288 tokens
    same = all(
        torch.equal(x, y)
        for x, y in zip(torch.load(tmp / "whole.pt"), torch.load(tmp / "chunked.pt"))
    )
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    after = _run(FULL_TOKENS, DEFAULT_DIVERGENCE_BYTES, args.repeats, fraction=args.fraction)
    after["seconds_whole_window"] = after["seconds"] / args.fraction
    after["pairs_whole_window"] = full_pairs
    result = {
        "scorer": "Jensen-Shannon over per-head key softmaxes (fp32), one global window, "
        "parity split",
        "width": {"heads": HEADS, "head_dim": HEAD_DIM},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": after["threads"],
            "torch": torch.__version__,
        },
        "before_measured": before,
        "before_peak_bytes_per_pair": per_pair,
        "before_full_estimate": {
            "tokens": FULL_TOKENS,
            "pairs": full_pairs,
            "peak_bytes": per_pair * full_pairs,
            "measured": False,
        },
        "after_full": after,
        "chunked_equals_unchunked_at_288_tokens": same,
        "check_runs": {"unchunked": whole, "chunked_1MiB": small_chunked},
    }
    RESULTS.mkdir(exist_ok=True)
    write_atomic(RESULTS / "divergence-memory.json", json.dumps(result, indent=2) + "\n")
    write_atomic(RESULTS / "divergence-memory.md", _markdown(result))
    print(_markdown(result))


def _markdown(r: dict) -> str:
    gib = 2**30
    lines = [
        "# A JS-divergence edge scorer at LLaVA-NeXT width, before and after chunking",
        "",
        f"{r['scorer']}; keys {r['width']['heads']} heads x {r['width']['head_dim']} dims; "
        f"CPU, {r['machine']['threads']} threads, torch {r['machine']['torch']}. "
        "Produced by `python benchmarks/divergence_memory.py`.",
        "",
        "| tokens in the window | pairs | call | peak memory | time |",
        "|---:|---:|---|---:|---:|",
    ]
    for m in r["before_measured"]:
        lines.append(
            f"| {m['tokens']:,} | {m['pairs']:,} | unchunked (measured) | "
            f"{m['peak_bytes'] / gib:.2f} GiB | {m['seconds']:.2f} s |"
        )
    est = r["before_full_estimate"]
    lines.append(
        f"| {est['tokens']:,} | {est['pairs']:,} | unchunked (**estimated**, cannot allocate here) "
        f"| {est['peak_bytes'] / gib:,.0f} GiB | - |"
    )
    a = r["after_full"]
    timed = (
        "measured"
        if a["source_fraction"] == 1
        else f"{a['seconds']:.1f} s measured on {a['source_fraction']:.0%} of the source rows, "
        "scaled"
    )
    lines.append(
        f"| {a['tokens']:,} | {a['pairs_whole_window']:,} | chunked, {a['budget_bytes'] // 2**20} "
        f"MiB budget (peak measured) | {a['peak_bytes'] / gib:.2f} GiB | "
        f"{a['seconds_whole_window']:.0f} s ({timed}) |"
    )
    lines += [
        "",
        "The estimate is the largest measured peak per pair "
        f"({r['before_peak_bytes_per_pair']:,.0f} bytes) times the pairs at 2,928 tokens. The "
        "chunked call returns exactly the unchunked result (checked at 288 tokens with a 1 MiB "
        f"budget: {'equal' if r['chunked_equals_unchunked_at_288_tokens'] else 'NOT equal'}).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
