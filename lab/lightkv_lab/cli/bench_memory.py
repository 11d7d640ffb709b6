"""``lightkv bench memory``: its parser and its command (the benchmark itself is
`lightkv_lab.bench.efficiency.memory`)."""

from __future__ import annotations

import argparse
import sys

from lightkv.cli.common import EXIT_OK, UsageError, at_most, machine_threads, writable_dir
from lightkv.cli.lists import MAX_NAMES, MAX_NUMBERS, merged

__all__ = ["add_memory_parser", "cmd_bench_memory"]

_LENGTH = at_most(65536, "attention over N tokens costs N^2; 16,384 takes minutes per point")
_LAYERS = at_most(80, "the deepest real decoder has 80 layers")
_HEADS = at_most(128, "each head is width / heads wide")
_WIDTH = at_most(16384, "the hidden states are tokens x width x 4 bytes")
_REPEATS = at_most(100, "each repeat is one more prefill per point")
_GB = at_most(4096, "gigabytes of memory")


def add_memory_parser(bsub) -> argparse.ArgumentParser:
    """The ``memory`` benchmark's parser, added to ``bench``'s subparsers."""
    mem = bsub.add_parser(
        "memory",
        help="peak memory and prefill time vs prompt length (1k to 16k tokens), every preset",
        description="Every preset beside the uncompressed model on a LLaVA-1.5-shaped random "
        "model (576 vision tokens, 8 layers, 4 heads, width 64), the prompt grown by text after "
        "the image; each (preset, length) in its own process: peak resident set during the "
        "prefill and its CPU time. Writes prefill-memory.json, prefill-memory.md and "
        "prefill-memory.png. The full run takes about an hour on 2 shared cores; --quick a few "
        "minutes.",
        formatter_class=argparse.HelpFormatter,
    )
    mem.add_argument(
        "--lengths",
        nargs="+",
        type=_LENGTH,
        metavar="N",
        help="prompt tokens, 576 of them vision (default: 1024 2048 4096 5600 9600 16384)",
    )
    mem.add_argument(
        "--presets", nargs="+", metavar="PRESET", help="presets to compare (default: every preset)"
    )
    mem.add_argument("--layers", type=_LAYERS, metavar="N", help="decoder depth (default: 8)")
    mem.add_argument("--heads", type=_HEADS, metavar="N", help="attention heads (default: 4)")
    mem.add_argument("--width", type=_WIDTH, metavar="D", help="hidden width (default: 64)")
    mem.add_argument(
        "--repeats", type=_REPEATS, metavar="N", help="timed prefills per point (default: 1)"
    )
    mem.add_argument(
        "--threads",
        type=machine_threads,
        metavar="N",
        help="torch CPU threads per process (default: 1)",
    )
    mem.add_argument(
        "--memory-limit",
        type=_GB,
        metavar="GB",
        help="data one point's process may map; past it the point is recorded as out of memory "
        "(default: 8)",
    )
    mem.add_argument(
        "--no-7b",
        dest="width7b",
        action="store_false",
        help="skip the LightKV relevance alone at 7B heads (32 of 128) on the longest prompt",
    )
    mem.add_argument(
        "--quick",
        action="store_true",
        help="1,024 and 4,096 tokens; uncompressed, lightkv-budget, fastv, divprune; no 7B point",
    )
    mem.add_argument(
        "--out",
        metavar="DIR",
        help="output folder (default: benchmarks/results, benchmarks/results/quick with --quick)",
    )
    mem.add_argument("--no-plots", action="store_true", help="write JSON and Markdown only")
    mem.add_argument("--no-progress", action="store_true", help="no progress bar")
    return mem


def cmd_bench_memory(args: argparse.Namespace) -> int:
    """Run the benchmark, write its files and print its tables."""
    from pathlib import Path

    from lightkv.cli.common import require

    if not args.no_plots:
        require("matplotlib", why="for its plot (or pass --no-plots)")
    from lightkv_lab.bench.efficiency import RESULTS
    from lightkv_lab.bench.efficiency import memory as mem
    from lightkv_lab.bench.efficiency.memory_report import memory_markdown, write_memory

    lengths = merged(args.lengths, "--lengths", MAX_NUMBERS)
    presets = merged(args.presets, "--presets", MAX_NAMES)
    over = {
        k: v
        for k, v in {
            "lengths": lengths,
            "presets": presets,
            "layers": args.layers,
            "heads": args.heads,
            "width": args.width,
            "repeats": args.repeats,
            "threads": args.threads,
            "memory_limit": None if args.memory_limit is None else args.memory_limit * 10**9,
        }.items()
        if v is not None
    }
    over.update(progress=not args.no_progress)
    if not args.width7b:
        over["width7b"] = False
    out = writable_dir(Path(args.out) if args.out else RESULTS / ("quick" if args.quick else ""))
    try:
        cfg = mem.quick_memory(**over) if args.quick else mem.MemoryConfig(**over)
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0]) from None
    result = mem.run_memory(cfg)
    files = write_memory(result, out, with_plot=not args.no_plots)
    sys.stdout.write(memory_markdown(result))
    for f in files:
        print(f"wrote {f}")
    return EXIT_OK
