"""Profile the compression's own work inside one prefill (torch.profiler, per hook family:
layout, relevance, stage, bookkeeping) and list the operators each spends its time in.

    python benchmarks/profile_overhead.py     # LLaVA-NeXT shape, width 1024, 6 layers
    python benchmarks/profile_overhead.py --width full --layers 4
    python benchmarks/profile_overhead.py --variants lightkv lightkv+second-projection tome

Writes ``benchmarks/results/overhead-profile.json`` (``--out`` to change) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from lightkv_lab.bench.efficiency import MODELS, RESULTS, BenchConfig
from lightkv_lab.bench.efficiency.profile import profile_prefill

from lightkv.outputs import write_atomic


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llava_next", choices=sorted(MODELS))
    ap.add_argument(
        "--variants", nargs="+", default=["lightkv", "lightkv+second-projection", "tome"]
    )
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--width", choices=("reduced", "full"), default="reduced")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "overhead-profile.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # preset@target variants (e.g. lightkv@0.22) are validated by their preset's name
    presets = tuple(dict.fromkeys(v.split("@")[0] for v in args.variants if "+" not in v)) or (
        "lightkv",
    )
    cfg = BenchConfig(
        models=(args.model,),
        presets=presets,
        layers=args.layers,
        heads=args.heads,
        width=args.width,
        memory=False,
        eager_reference=False,
        progress=False,
    )
    t0 = time.perf_counter()
    runs = [profile_prefill(MODELS[args.model], cfg, v) for v in args.variants]
    for r in runs:
        print(
            f"\n{r['variant']}: prefill {r['prefill_ms']:.0f} ms, compression {r['share']:.1%} "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in r["parts_ms"].items())
        )
        for part, ops in r["ops"].items():
            print(f"  {part}: " + "; ".join(f"{n} {ms:.1f} ms x{c}" for n, ms, c in ops[:6]))
    out = {
        "command": "python benchmarks/profile_overhead.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - t0,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps(out, indent=1))
    md = args.out.with_suffix(".md")
    write_atomic(md, markdown(out))
    print(f"wrote {args.out}\nwrote {md}")
    return 0


def markdown(out: dict) -> str:
    """Per variant: prefill, the hook families' time and the operators each spends it in."""
    d = out["runs"][0]["decoder"]
    lines = [
        f"`{out['command']}` ({d['layers']} layers, width {d['hidden']}, {out['threads']} threads; "
        "operator times are self CPU time under the profiler, which inflates small operators)",
        "",
        "| variant | prefill ms | compression | part | ms | top operators (self ms x calls) |",
        "|---|---:|---:|---|---:|---|",
    ]
    for r in out["runs"]:
        first = True
        for part, ms in r["parts_ms"].items():
            ops = "; ".join(f"`{n}` {t:.1f} x{c}" for n, t, c in r["ops"].get(part, [])[:3])
            head = (
                f"| {r['variant']} | {r['prefill_ms']:.0f} | {r['share']:.1%} |"
                if first
                else "| | | |"
            )
            lines.append(f"{head} {part} | {ms:.1f} | {ops} |")
            first = False
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
