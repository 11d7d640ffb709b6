"""TTFT against FLOPs at full 7B width, the prefill split by component (issue 49, item 5):
`lightkv-cover` (its bias on the 4-D mask, and through the extra head channel), the same kept
tokens without the bias, and DivPrune, at 22 / 11 / 5% kept, on LLaVA-NeXT-7B's shape (a
real-size CLIP-L/336 tower, five tiles, 2,928 vision tokens; the decoder at 16 layers: 32
in float32 do not fit 24 GiB). The logic is `lightkv_lab.bench.efficiency.components`.

    python benchmarks/ttft_components.py --threads 2 --out benchmarks/results/full-width  # ~25 min
    python benchmarks/ttft_components.py --tiny --rounds 1 --out /tmp/tc                   # a check
    python benchmarks/ttft_components.py --report benchmarks/results/full-width/ttft-components.json

Writes ``ttft-components.json`` and ``ttft-components.md`` into ``--out`` (atomically).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lightkv_lab.bench.efficiency.components import (
    PRESETS,
    ComponentConfig,
    add_bias,
    components_markdown,
    run_components,
)

from lightkv.outputs import write_atomic


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kept", type=float, nargs="+", default=[0.22, 0.11, 0.05])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="a tiny model: checks the script")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/full-width"))
    ap.add_argument(
        "--report", type=Path, help="only rewrite the Markdown (and bias) of an earlier JSON"
    )
    args = ap.parse_args(argv)
    if args.report:
        result = json.loads(args.report.read_text())
        add_bias(result["rows"])
        write_atomic(args.report, json.dumps(result, indent=1))
        write_atomic(args.report.with_suffix(".md"), components_markdown(result))
        print(components_markdown(result))
        return 0
    cfg = ComponentConfig(
        layers=args.layers,
        kept=tuple(args.kept),
        presets=tuple(args.presets),
        rounds=args.rounds,
        threads=args.threads,
        tiny=args.tiny,
    )
    result = run_components(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    result["command"] = "python benchmarks/ttft_components.py " + " ".join(argv or sys.argv[1:])
    md = components_markdown(result)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "ttft-components.json", json.dumps(result, indent=1))
    write_atomic(args.out / "ttft-components.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
