"""The command line of ``lightkv bench``: its benchmarks' parsers, options and limits (the
commands themselves are in `lightkv_lab.cli.bench`)."""

from __future__ import annotations

import argparse

from lightkv.cli.common import EXIT_USAGE, PROG, Parser, at_most, machine_threads

__all__ = ["add_parsers"]


def _removed_flag(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Refuse ``old``, a renamed flag, in one line naming ``new`` (exit status 2), before
    any work; hidden from the help. There is no release to stay compatible with, and a
    warning nobody sees beside a value silently used is worse than the error."""

    class Removed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.exit(EXIT_USAGE, f"{PROG}: error: {old} was renamed; use {new}\n")

    parser.add_argument(old, nargs="*", action=Removed, help=argparse.SUPPRESS)


# Upper limits: a typo such as 1e9 is refused before any work, with what one unit costs.
_FULL_LAYERS = at_most(
    80,
    "the deepest real decoder has 80 layers; at --width full each 7B-wide layer "
    "holds 0.8 GB of float32 weights",
)
_LAYERS = at_most(80, "the deepest real decoder has 80 layers")
_HEADS = at_most(128, "the width is heads x 128")
_PREFILL_REPEATS = at_most(100, "each repeat is one prefill per variant and model")
_POINT_REPEATS = at_most(100, "each repeat times every point again")
_SIDES = at_most(256, "a side of S tokens is S^2 vision tokens; 256 is 65,536")
_WIDTH = at_most(
    16384, "hidden states are tokens x width x 4 bytes; 16,384 x 7,225 tokens is 0.5 GB"
)
_EPISODES = at_most(
    20000, "about 0.05 s per conversation and method on 2 cores: 20,000 is about 5 hours"
)
_BATCH = at_most(1000, "a batch of B conversations holds B prompts of about 300 tokens at once")
_ABLATION_EPISODES = at_most(20000, "about 0.05 s per conversation and variant on 2 cores")


def add_parsers(commands) -> dict[str, argparse.ArgumentParser]:
    """Add ``bench`` and its benchmarks' parsers to the top-level subparsers; returns them by
    name (``bench`` and each benchmark), for `lightkv_lab.cli.bench` to attach the commands."""
    fmt = argparse.HelpFormatter
    bench = commands.add_parser(
        "bench",
        help="run the shipped benchmarks",
        description="Efficiency on random-weight models with real vision-token counts; quality "
        "with the bundled models (Scenes by default).",
        formatter_class=fmt,
    )
    bsub = bench.add_subparsers(
        dest="bench_command", metavar="BENCHMARK", title="benchmarks", parser_class=Parser
    )
    eff = bsub.add_parser(
        "efficiency",
        help="prefill FLOPs, KV bytes, TTFT, peak memory and overhead: uncompressed vs presets",
        description="Uncompressed vs each preset on LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, "
        "Qwen2.5-VL (image and 16-frame video) and InternVL shapes (real vision-token counts, "
        "reduced decoders): analytic FLOPs, KV bytes from the cache, time to first token, peak "
        "prefill memory, compression overhead and the cost of reference-style H x N x N scoring. "
        "Writes efficiency.json, efficiency.md and PNG plots.",
        formatter_class=fmt,
    )
    eff.add_argument(
        "--quick",
        action="store_true",
        help="a short run: 6 layers of width 128, 2 presets, 3 repeats (317 s of CPU time "
        "measured: about 3-5 min on a quiet 2-core machine, 10 min on a loaded one)",
    )
    eff.add_argument(
        "--models",
        nargs="+",
        metavar="MODEL",
        help="llava, llava_next, llava_onevision, qwen2_5_vl, qwen2_5_vl_video, internvl "
        "(default: all)",
    )
    eff.add_argument(
        "--presets",
        nargs="+",
        metavar="PRESET",
        help="presets to compare (default: lightkv tome fastv pdrop elasticcache h2o)",
    )
    eff.add_argument(
        "--kept-fractions",
        dest="budgets",
        nargs="+",
        type=float,
        metavar="F",
        help="kept fractions (e.g. 0.55 0.22 0.11): every preset at each, as the quality benchmark "
        "puts it there (default: each preset's own schedule)",
    )
    eff.add_argument(
        "--out",
        metavar="DIR",
        help="output folder (default: benchmarks/results, benchmarks/results/quick with --quick)",
    )
    eff.add_argument(
        "--repeats",
        type=_PREFILL_REPEATS,
        metavar="N",
        help="timed prefills per variant (default: 3)",
    )
    eff.add_argument(
        "--layers",
        type=_FULL_LAYERS,
        metavar="N",
        help="reduced decoder depth (default: 8; 6 with --quick)",
    )
    eff.add_argument(
        "--width",
        choices=("reduced", "full"),
        default=None,
        help="full: the real models' width, heads and MLP (7B: 4096 / 32 heads / 11008), only the "
        "depth reduced (--layers); reduced (default): --heads x 128",
    )
    eff.add_argument(
        "--heads",
        type=_HEADS,
        metavar="N",
        help="query heads of the reduced width (default: 4 or 7 per model)",
    )
    eff.add_argument(
        "--projection-baseline",
        action="store_true",
        help="also time lightkv projecting each scheduled layer's input a second time (what "
        "reading the layer's own projections saves)",
    )
    eff.add_argument(
        "--no-eager-reference",
        action="store_true",
        help="skip the reference-style H x N x N scoring runs",
    )
    eff.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    eff.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    eff.add_argument(
        "--attn-implementation",
        choices=("sdpa", "eager", "flash_attention_2"),
        default="sdpa",
        help="the models' attention, for the uncompressed and the compressed prefills alike "
        "(default: sdpa); flash_attention_2 needs CUDA, flash_attn and bf16/fp16; every variant "
        "must run the same one",
    )
    eff.add_argument(
        "--threads", type=machine_threads, metavar="N", help="torch CPU threads (default: torch's)"
    )
    eff.add_argument(
        "--allocator",
        choices=("steady", "system"),
        default="steady",
        help="host memory of the timed prefills: steady (default) reuses freed memory as PyTorch's "
        "caching allocator does on a GPU, but holds what it frees (deep --width full runs may need "
        "more memory); system is glibc's default, whose fresh pages for large blocks cost a long "
        "prefill more than a short one",
    )
    eff.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    eff.add_argument("--no-plots", action="store_true", help="write JSON and Markdown only")
    eff.add_argument(
        "--quiet", action="store_true", help="no progress bar (none either when not a terminal)"
    )
    _removed_flag(eff, "--no-progress", "--quiet")
    _removed_flag(eff, "--budgets", "--kept-fractions")
    sc = bsub.add_parser(
        "scaling",
        help="stage and prefill cost vs vision-token count (576 to 7,225), with fitted exponents",
        description="Times the lightkv preset's stage chain on random hidden states (preset "
        "windows and fixed 8x8-token windows) and whole prefills of a LLaVA-shaped model, for "
        "square images of each --sides; fits t ~ N^k. Writes scaling.json, scaling.md and "
        "efficiency-scaling.png.",
        formatter_class=fmt,
    )
    sc.add_argument(
        "--sides",
        nargs="+",
        type=_SIDES,
        metavar="S",
        help="image sides in tokens (default: 24 32 54 85)",
    )
    sc.add_argument(
        "--width", type=_WIDTH, metavar="D", help="hidden width of the stage timing (default: 4096)"
    )
    sc.add_argument(
        "--heads", type=_HEADS, metavar="N", help="prefill decoder heads x 128 (default: 4)"
    )
    sc.add_argument(
        "--layers", type=_LAYERS, metavar="N", help="prefill decoder depth (default: 8)"
    )
    sc.add_argument(
        "--repeats", type=_POINT_REPEATS, metavar="N", help="timed runs per point (default: 3)"
    )
    sc.add_argument(
        "--threads", type=machine_threads, metavar="N", help="torch CPU threads (default: torch's)"
    )
    sc.add_argument("--no-prefill", action="store_true", help="time the stage chain only")
    sc.add_argument(
        "--quick", action="store_true", help="small sides, narrow models, one repeat (seconds)"
    )
    sc.add_argument(
        "--out",
        metavar="DIR",
        help="output folder (default: benchmarks/results, .../quick with --quick)",
    )
    sc.add_argument("--no-plots", action="store_true", help="write JSON and Markdown only")
    kq = bsub.add_parser(
        "kvquant",
        help="KV bytes with lightkv, with KV quantization (fp8, quanto 4 / 2 bits) and with both",
        description="One prefill per model shape and variant; counts the bytes the cache holds "
        "(lightkv.adapters.kv_bytes). quanto needs the quant extra: pip install "
        "'optimum-quanto>=0.2.7'. "
        "Writes kv-quantization.json and kv-quantization.md.",
        formatter_class=fmt,
    )
    kq.add_argument(
        "--models", nargs="+", metavar="MODEL", help="default: llava llava_next qwen2_5_vl"
    )
    kq.add_argument(
        "--backends",
        nargs="+",
        metavar="NAME",
        help="fp8, quanto-4, quanto-2 (default: those installed)",
    )
    kq.add_argument(
        "--layers", type=_LAYERS, metavar="N", help="reduced decoder depth (default: 8)"
    )
    kq.add_argument("--out", metavar="DIR", help="output folder (default: benchmarks/results)")
    qual = bsub.add_parser(
        "quality",
        help="accuracy and fidelity vs kept vision KV with the bundled model, every method",
        description="Every method (preset) at kept vision-KV targets of about 100/75/55/40/25%, "
        "its schedule scaled to the model's depth, on held-out conversations (a question, then a "
        "follow-up about another region): exact match per question type, KL to the uncompressed "
        "answer distribution, log-probability drop, paired bootstrap intervals vs lightkv, an "
        "ablation table at 55%, realised kept fraction and vision KV bytes. Writes "
        "quality-<task>.json, .md, .png and quality-<task>-provenance.png.",
        formatter_class=fmt,
    )
    qual.add_argument(
        "--episodes",
        type=_EPISODES,
        default=600,
        metavar="N",
        help="held-out conversations (default: 600)",
    )
    qual.add_argument(
        "--methods",
        nargs="+",
        metavar="PRESET",
        help="presets (default: every method of the quality results page)",
    )
    qual.add_argument(
        "--kept-fractions",
        dest="targets",
        nargs="+",
        type=float,
        metavar="F",
        help="kept fractions (default: 1 .75 .55 .4 .25)",
    )
    qual.add_argument(
        "--baseline",
        metavar="PRESET",
        help="the comparator of the paired bootstrap intervals, one of --methods (default: the "
        "first lightkv method given; without one the interval columns are empty, with a note)",
    )
    qual.add_argument(
        "--quiet", action="store_true", help="no progress bar (none either when not a terminal)"
    )
    qual.add_argument(
        "--model",
        metavar="NAME|DIR",
        default="scenes",
        help="a bundled model (scenes, photos, digitgrid, symbolgrid) or a model directory the "
        "trainer wrote (default: scenes)",
    )
    qual.add_argument("--no-ablations", action="store_true", help="skip the ablation table")
    qual.add_argument(
        "--ablation-kept-fractions",
        dest="ablation_targets",
        nargs="+",
        type=float,
        metavar="F",
        help="kept fractions of the ablation table (default: .55)",
    )
    qual.add_argument("--no-followup", action="store_true", help="no follow-up questions")
    qual.add_argument(
        "--seed", type=int, default=0, help="which held-out conversations (default: 0)"
    )
    qual.add_argument(
        "--batch", type=_BATCH, default=100, metavar="N", help="episodes per batch (default: 100)"
    )
    qual.add_argument("--out", metavar="DIR", help="output folder (default: benchmarks/results)")
    qual.add_argument(
        "--threads", type=machine_threads, metavar="N", help="torch CPU threads (default: torch's)"
    )
    _removed_flag(qual, "--targets", "--kept-fractions")
    _removed_flag(qual, "--ablation-targets", "--ablation-kept-fractions")
    abl = bsub.add_parser(
        "ablation",
        help="LightKV variants vs the reference and baselines at equal budget, with paired "
        "intervals",
        description="Each variant of LightKV (size-aware messages, relevance-decided splits and "
        "budgets, other relevance scores) and each baseline at 55% and 40% of the vision KV cache, "
        "on the bundled SymbolGrid and DigitGrid models: exact match per question type and KL, "
        "with paired bootstrap intervals of lightkv minus each. Writes ablation.json, .md and "
        ".png.",
        formatter_class=fmt,
    )
    abl.add_argument(
        "--models", nargs="+", metavar="NAME|DIR", help="models (default: symbolgrid digitgrid)"
    )
    abl.add_argument(
        "--episodes",
        type=_ABLATION_EPISODES,
        default=240,
        metavar="N",
        help="conversations per model (default: 240)",
    )
    abl.add_argument(
        "--kept-fractions",
        dest="targets",
        nargs="+",
        type=float,
        metavar="F",
        help="kept fractions (default: .55 .4)",
    )
    abl.add_argument("--variants", nargs="+", metavar="NAME", help="variants (default: all)")
    abl.add_argument(
        "--baselines", nargs="+", metavar="PRESET", help="baseline presets (default: six)"
    )
    abl.add_argument("--out", metavar="DIR", help="output folder (default: benchmarks/results)")
    abl.add_argument(
        "--threads", type=machine_threads, metavar="N", help="torch CPU threads (default: torch's)"
    )
    abl.add_argument(
        "--quiet", action="store_true", help="no progress bar (none either when not a terminal)"
    )
    _removed_flag(abl, "--targets", "--kept-fractions")
    from lightkv_lab.cli.bench_memory import add_memory_parser

    return {
        "memory": add_memory_parser(bsub),
        "bench": bench,
        "efficiency": eff,
        "scaling": sc,
        "kvquant": kq,
        "quality": qual,
        "ablation": abl,
    }
