"""Choose a method's hyper-parameters on a development split of Scenes conversations.

The development conversations come from a seed of their own (``--seed``, default 4101),
never the benchmark's (seed 0, and seed 1 for its relevance table). Every configuration
tried is appended, with its per-conversation correctness, to a JSON-lines file, so the
search can be stopped and resumed and every try is on record
(``benchmarks/results/method-search/``).

    python benchmarks/method_search.py --configs cover --targets 0.22 0.11

A configuration is a preset name plus YAML overrides (``pruner``, ``passer``,
``relevance`` ...) put at a kept fraction by the benchmarks' rule
(`lightkv_lab.bench.budgets.knob_pipeline`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.tasks import model as dg
from lightkv_lab.tasks import scoring as sc

from lightkv.policies import MessagePasser, Partitioner, Pruner, Relevance

OUT = Path(__file__).resolve().parent / "results" / "method-search"

FAMILIES = {
    "pruner": Pruner,
    "passer": MessagePasser,
    "relevance": Relevance,
    "partitioner": Partitioner,
}


def _cover(share, power, relevance="question_attention", passer="relevance_mean", spatial=0.0):
    params = {"share": share, "power": power} | ({"spatial": spatial} if spatial else {})
    return {
        "preset": "lightkv-cover",
        "pruner": ["relevance_coverage", params],
        "passer": [passer, {}],
        "relevance": [relevance, {}],
    }


GRIDS = {
    "baselines": [
        {"preset": "divprune"},
        {"preset": "cdpruner"},
        {"preset": "lightkv"},
        {"preset": "divprune", "passer": ["relevance_mean", {}], "scorer": "cosine"},
        {"preset": "divprune", "passer": ["size_mean", {}], "scorer": "cosine"},
    ],
    "cover": [
        _cover(s, p, r)
        for r in ("question_attention", "query_softmax")
        for s in (0.0, 0.25, 0.5)
        for p in (0.0, 1.0)
    ],
    "cover-drop": [
        _cover(s, p, "question_attention", "drop") for s in (0.0, 0.25, 0.5) for p in (0.0, 1.0)
    ],
    "spatial": [
        _cover(s, 0.0, r, spatial=sp)
        for sp in (0.25, 0.5, 1.0)
        for s in (0.0, 0.25)
        for r in ("question_attention", "query_softmax")
    ],
    "spatial-power": [
        _cover(s, p, "question_attention", spatial=sp)
        for sp in (0.1, 0.25)
        for s in (0.0, 0.1)
        for p in (0.5, 1.0)
    ],
    "proportional": [
        _cover(0.0, 0.0, "question_attention", spatial=0.25) | {"proportional": True},
        _cover(0.25, 0.0, "question_attention", spatial=0.25) | {"proportional": True},
        _cover(0.0, 0.0, "uniform", spatial=0.25) | {"proportional": True},
        {
            "preset": "divprune",
            "passer": ["size_mean", {}],
            "scorer": "cosine",
            "proportional": True,
        },
    ],
    "final": [
        _cover(0.25, 0.0, "question_attention", spatial=0.25) | {"proportional": True},
        _cover(0.25, 0.0, "uniform", spatial=0.25) | {"proportional": True},
        {"preset": "divprune"},
        {"preset": "cdpruner"},
        {"preset": "lightkv"},
        {
            "preset": "divprune",
            "passer": ["size_mean", {}],
            "scorer": "cosine",
            "proportional": True,
        },
        {
            "preset": "cdpruner",
            "passer": ["relevance_mean", {}],
            "scorer": "cosine",
            "proportional": True,
        },
    ],
    "leaders": [{"preset": p} for p in ("scope", "mmtok", "holov", "vscan")],
    "cover-relevance": [_cover(0.25, 1.0, r) for r in ("last_token", "text_attention", "uniform")],
    # the cost round: a relevance without layer 0's second projection, and coverage inside
    # 2 x 2 windows of each image instead of one N x N block per image
    "cheap": [
        _cover(0.25, 0.0, r, spatial=0.25) | {"proportional": True} | w
        for w in ({}, {"partitioner": ["grid", {"split": "all_src"}], "windows": 2})
        for r in ("question_similarity", "uniform", "question_attention")
    ],
    # the same windows once relevance_coverage spread each image's exact budget over them
    # (the runs above kept 23.4 / 12.5%: each window rounded its own count)
    # the preset as shipped after the cost round (question_similarity, 2 x 2 windows, exact per
    # image, distances in float32), and the same with relevance off
    "cover-v2": [
        {"preset": "lightkv-cover", "version": 2},
        {"preset": "lightkv-cover", "version": 2, "relevance": ["uniform", {}]},
    ],
    "cheap-exact": [
        _cover(0.25, 0.0, r, spatial=0.25)
        | {"proportional": True, "budget": "per image"}
        | {"partitioner": ["grid", {"split": "all_src"}], "windows": w}
        for w in (2, 3)
        for r in ("question_similarity", "uniform")
    ],
}


def build(cfg: dict, num_layers: int, target: float):
    from lightkv.policies import EdgeScorer

    pipe, how = knob_pipeline(cfg["preset"], num_layers, target)
    swaps = {}
    for family, cls in FAMILIES.items():
        if family in cfg:
            name, params = cfg[family]
            swaps[family] = cls.create(name, **params)
    if "scorer" in cfg:
        swaps["scorer"] = EdgeScorer.create(cfg["scorer"])
    if "windows" in cfg:
        swaps["scheduler"] = replace(pipe.scheduler, windows_per_side=cfg["windows"])
    if cfg.get("proportional"):
        swaps["proportional_attention"] = True
    return replace(pipe, **swaps), how


def key(cfg: dict, target: float) -> str:
    return json.dumps({"cfg": cfg, "target": target}, sort_keys=True)


def append(path: Path, record: dict) -> None:
    """Append one JSON line; the file is rewritten to a temporary file and renamed, so a
    crash never leaves half a line."""
    old = path.read_text() if path.exists() else ""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(old + json.dumps(record) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["baselines"], choices=sorted(GRIDS))
    ap.add_argument("--targets", nargs="+", type=float, default=[0.22, 0.11])
    ap.add_argument("--episodes", type=int, default=400)
    ap.add_argument("--seed", type=int, default=4101)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--benchmark",
        action="store_true",
        help="allow the benchmark's seeds (0, 1): only for the final numbers of a chosen "
        "configuration",
    )
    args = ap.parse_args(argv)
    if args.seed in (0, 1) and not args.benchmark:
        ap.error(
            "--seed 0 and 1 are the benchmark's conversations: choose a development seed of its own"
        )
    torch.set_num_threads(args.threads)
    OUT.mkdir(parents=True, exist_ok=True)
    path = args.out or OUT / f"dev-seed{args.seed}-n{args.episodes}.jsonl"
    done = set()
    if path.exists():
        done = {
            key(r["cfg"], r["target"])
            for r in map(json.loads, path.read_text().splitlines())
            if "cfg" in r
        }
    model, _, grid = dg.load(dg.resolve_model("scenes"))
    layers = model.config.text_config.num_hidden_layers
    convs = sc.conversations(args.episodes, grid, seed=args.seed)
    t0 = time.time()
    if key({"uncompressed": True}, 1.0) not in done:
        base = sc.score(model, convs, grid, None, batch=100)
        append(
            path,
            {
                "cfg": {"uncompressed": True},
                "target": 1.0,
                "kept": 1.0,
                "accuracy": base.accuracy(),
                "correct": base.correct.tolist(),
                "followup_correct": base.followup_correct.tolist(),
            },
        )
    for name in args.configs:
        for cfg in GRIDS[name]:
            for target in args.targets:
                if key(cfg, target) in done:
                    continue
                pipe, how = build(cfg, layers, target)
                res = sc.score(model, convs, grid, pipe, batch=100)
                acc = res.accuracy()
                overall = float(res.correct.float().mean())
                append(
                    path,
                    {
                        "cfg": cfg,
                        "target": target,
                        "how": how,
                        "kept": res.kept_fraction,
                        "overall": overall,
                        "accuracy": acc,
                        "correct": res.correct.tolist(),
                        "followup_correct": res.followup_correct.tolist(),
                    },
                )
                done.add(key(cfg, target))
                print(
                    f"[{time.time() - t0:5.0f}s] {target:.2f} kept {res.kept_fraction:.3f} overall "
                    f"{overall:.4f} follow {acc.get('followup', float('nan')):.3f}  "
                    f"{json.dumps(cfg)}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
