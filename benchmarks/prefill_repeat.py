"""One variant's full-width prefill, again and again in one process, nothing in between: does
its time settle after one warm-up? (The efficiency benchmark interleaves every variant in
each round; there the uncompressed 7B-wide prefill kept getting faster for four rounds.)

    python benchmarks/prefill_repeat.py --runs 8 \
        --out benchmarks/results/low-budget/prefill-repeat.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from lightkv_lab.bench.allocator import ALLOCATORS, host_allocator
from lightkv_lab.bench.efficiency import BenchConfig
from lightkv_lab.bench.efficiency.measure import first_token
from lightkv_lab.bench.efficiency.shapes import MODELS, build_model

from lightkv.outputs import write_atomic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llava_next", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--allocator", choices=ALLOCATORS, default="steady")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = BenchConfig(
        models=(args.model,),
        width="full",
        layers=args.layers,
        memory=False,
        eager_reference=False,
        allocator=args.allocator,
    )
    seconds = []
    with host_allocator(cfg.allocator) as heap, torch.no_grad():
        model, inputs, _ = build_model(MODELS[args.model], cfg)
        for i in range(args.runs):
            t = time.perf_counter()
            out = first_token(model, inputs)
            seconds.append(time.perf_counter() - t)
            del out
            print(f"prefill {i}: {seconds[-1]:.2f} s", flush=True)
    res = {
        "model": args.model,
        "layers": args.layers,
        "width": "full",
        "threads": torch.get_num_threads(),
        "allocator": heap,
        "tokens": int(inputs["input_ids"].shape[1]),
        "seconds": seconds,
    }
    if args.out:
        write_atomic(args.out, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
