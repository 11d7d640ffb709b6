"""Each paper-named preset as its authors released it against lightkv's former variant of it,
on the quality benchmark's Scenes conversations (seed 0, 600, with follow-ups).

Issue 48 made every preset that carries a paper's name reproduce the authors' code by default
(recorded fixtures in ``tests/methods``). This measures what that changed: first-answer
accuracy as a share of the uncompressed model's (the results pages' "retained"), and the
paired difference variant minus authors' (points, bootstrap 95% interval), at the benchmarks'
kept fractions (`lightkv_lab.bench.budgets.knob_pipeline`, the library's knob). The committed
results were measured before the knob landed, with the laboratory's former budget helper
(``method_pipeline``, since removed): the pre-LLM presets' pipelines are the same under both;
DART's and VScan's stages may sit elsewhere now, so rerun before comparing them.

    python benchmarks/faithful_variants.py --targets 0.55 0.22 0.11

Writes ``benchmarks/results/faithful/variants.{md,json}`` (atomically).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.tasks import model as dg
from lightkv_lab.tasks import scoring as sc

from lightkv.outputs import write_atomic
from lightkv.policies import MessagePasser

OUT = Path(__file__).resolve().parent / "results" / "faithful"


def _swap(part: str, **params):
    return lambda pipe: replace(pipe, **{part: replace(getattr(pipe, part), **params)})


VARIANTS = {
    # preset: (the variant's label, how it differs from the preset)
    "cdpruner": ("cdpruner-pos (relevance not negated)", _swap("pruner", negate=False)),
    "visionzip": (
        "no CLS slot, mean of target and merged",
        lambda p: replace(
            _swap("partitioner", cls_slot=False)(p), passer=MessagePasser.create("size_mean")
        ),
    ),
    "dart": ("pivots by norm order", _swap("pruner", pivot_order="norm")),
    "holov": ("overflow spread", _swap("pruner", overflow="spread")),
    "vscan": ("local scan on the projector's layer", _swap("partitioner", local_layer=None)),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", nargs="+", type=float, default=[0.55, 0.22, 0.11])
    ap.add_argument("--methods", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--episodes", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _, grid = dg.load(dg.resolve_model("scenes"))
    layers = model.config.text_config.num_hidden_layers
    convs = sc.conversations(args.episodes, grid, seed=0, followup=True)
    t0 = time.time()
    base = sc.score(model, convs, grid, None)
    ref = float(base.correct.double().mean())
    rows = []
    for name in args.methods:
        label, variant = VARIANTS[name]
        for target in args.targets:
            pipe, _ = knob_pipeline(name, layers, target)
            ours = sc.score(model, convs, grid, pipe)
            other = sc.score(model, convs, grid, variant(pipe))
            diff = sc.paired_bootstrap(other.correct.double(), ours.correct.double())
            rows.append(
                {
                    "preset": name,
                    "variant": label,
                    "target": target,
                    "kept": [ours.kept_fraction, other.kept_fraction],
                    "retained": [float(r.correct.double().mean()) / ref for r in (ours, other)],
                    "variant_minus_preset": [100 * v for v in diff],
                }
            )
            print(f"[{time.time() - t0:5.0f}s] {rows[-1]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    head = (
        f"Scenes, {args.episodes} conversations (seed 0), uncompressed accuracy {ref:.4f}; "
        "retained: first-answer accuracy / uncompressed; difference: points, variant minus "
        "preset, paired bootstrap 95% interval.\n\n"
        "| preset | target | kept | retained (authors') | variant | kept | retained | "
        "variant - preset |\n|---|---:|---:|---:|---|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['preset']} | {r['target']:.0%} | {r['kept'][0]:.1%} | {r['retained'][0]:.1%} | "
        f"{r['variant']} | {r['kept'][1]:.1%} | {r['retained'][1]:.1%} | "
        "{:+.1f} [{:+.1f}, {:+.1f}] |".format(*r["variant_minus_preset"])
        for r in rows
    ]
    write_atomic(args.out / "variants.md", head + "\n".join(lines) + "\n")
    write_atomic(
        args.out / "variants.json", json.dumps({"uncompressed": ref, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
