"""The ``lightkv`` command line.

```
lightkv presets [-v]                               list the shipped presets
lightkv config show NAME|FILE [--num-layers N]     print a pipeline as canonical YAML
lightkv config validate NAME|FILE [--num-layers N] [--grid HxW]
lightkv config schema                              JSON Schema of pipeline files
lightkv bench efficiency [--quick] [--models ...] [--presets ...] [--out DIR] [--repeats N]
lightkv bench quality [--model digitgrid|DIR] [--episodes N] [--methods ...] [--targets ...]
lightkv generate [--model DIR|ID] [--image FILE] [--prompt TEXT] [--preset NAME | --config FILE] [--compare]
lightkv demo [--preset NAME] [--questions N]       the bundled DigitGrid LVLM, with and without LightKV
lightkv stages-demo [--preset NAME]                the pure core on a real image, no model
```

Exit status: 0 on success, 1 when a configuration is invalid, 2 on a usage error (bad
arguments, a missing file, an unknown preset). Errors are printed as one line each on
stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

PROG = "lightkv"
EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2

_DESCRIPTION = """\
Make the KV cache of vision-language models lighter: merge or drop vision tokens during
prefill with pipelines composed of small policies (LightKV, FastV, ToMe, PyramidDrop, ...).
Pipelines are YAML files or shipped presets."""

_EPILOG = """\
examples:
  lightkv presets                               list the presets
  lightkv config show lightkv > mine.yaml       start a pipeline from a preset
  lightkv config validate mine.yaml --num-layers 28
  lightkv config schema > lightkv.schema.json   for editor completion and checks
  lightkv bench efficiency --quick              prefill FLOPs, KV bytes, TTFT, memory, overhead
  lightkv generate --model llava-hf/llava-1.5-7b-hf --image cat.png --prompt "What is this?" --compare

exit status: 0 ok, 1 invalid configuration, 2 usage error (bad arguments, missing file,
unknown preset)."""


_EXTRAS = {"skimage": "demo", "sklearn": "demo", "matplotlib": "bench", "tqdm": "bench", "torch_scatter": "scatter"}
"""Top-level module -> the extra of lightkv that installs it (for one-line errors)."""


class _UsageError(Exception):
    """A problem with what the user asked for (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _grid(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS such as 24x24, got {text!r}") from None
    if h < 1 or w < 1:
        raise argparse.ArgumentTypeError(f"grid sides must be positive, got {text!r}")
    return h, w


def _depth(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation tools)."""
    from . import __version__

    parser = _Parser(
        prog=PROG, description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    fmt = argparse.HelpFormatter
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=_Parser)

    p = commands.add_parser(
        "presets",
        help="list the shipped presets with one-line descriptions",
        description="List the shipped presets: LightKV with per-model schedules, and baselines "
        "(FastV, ToMe, PyramidDrop, pooling, random) built from the same policies.",
        formatter_class=fmt,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="also print each description and source")
    p.set_defaults(func=_cmd_presets)

    cfg = commands.add_parser(
        "config",
        help="show, validate or describe pipeline configurations",
        description="Work with pipeline configurations: presets by name or YAML files by path.",
        formatter_class=fmt,
    )
    sub = cfg.add_subparsers(dest="config_command", metavar="ACTION", title="actions", parser_class=_Parser)
    target_help = "a preset name (see `lightkv presets`) or a YAML file"
    depth_help = "decoder depth of the target model: check the schedule against it and show its stages"

    show = sub.add_parser(
        "show",
        help="print a preset or file as canonical YAML",
        description="Print a pipeline as canonical YAML (a good starting point for your own file).",
        formatter_class=fmt,
    )
    show.add_argument("target", metavar="NAME|FILE", help=target_help)
    show.add_argument("--num-layers", type=_depth, metavar="N", help=depth_help)
    show.add_argument("--format", choices=("yaml", "json"), default="yaml", help="output format (default: yaml)")
    show.set_defaults(func=_cmd_show)

    val = sub.add_parser(
        "validate",
        help="check a pipeline file and dry-run it on a synthetic image",
        description="Validate a pipeline file: its fields, policy names and parameters, the "
        "schedule against a model depth, and a dry run on random hidden states.",
        formatter_class=fmt,
    )
    val.add_argument("target", metavar="FILE", help="a YAML file (or a preset name)")
    val.add_argument("--num-layers", type=_depth, metavar="N", help=depth_help + " (default: 32)")
    val.add_argument("--grid", type=_grid, default=(24, 24), metavar="HxW", help="image grid of the dry run (default: 24x24)")
    val.set_defaults(func=_cmd_validate)

    schema = sub.add_parser(
        "schema",
        help="print the JSON Schema of pipeline files",
        description="Print the JSON Schema of pipeline files, including every registered "
        "policy name and its parameters (third-party policies too, once installed).",
        formatter_class=fmt,
    )
    schema.add_argument("--indent", type=int, default=2, help="JSON indentation (default: 2)")
    schema.set_defaults(func=_cmd_schema)
    cfg.set_defaults(func=lambda args: _missing_action(cfg))

    bench = commands.add_parser(
        "bench",
        help="run the shipped benchmarks",
        description="Efficiency on random-weight models with real vision-token counts; quality with the "
        "bundled DigitGrid model.",
        formatter_class=fmt,
    )
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", title="benchmarks", parser_class=_Parser)
    eff = bsub.add_parser(
        "efficiency",
        help="prefill FLOPs, KV bytes, TTFT, peak memory and overhead: uncompressed vs presets",
        description="Uncompressed vs each preset on LLaVA-1.5, LLaVA-NeXT, Qwen2.5-VL and InternVL shapes "
        "(real vision-token counts, reduced decoders): analytic FLOPs, KV bytes from the cache, time to first "
        "token, peak prefill memory, compression overhead and the cost of reference-style H x N x N scoring. "
        "Writes efficiency.json, efficiency.md and PNG plots.",
        formatter_class=fmt,
    )
    eff.add_argument("--quick", action="store_true", help="a short run (~2 min on CPU): 6 layers of width 128, 2 presets, 3 repeats")
    eff.add_argument("--models", nargs="+", metavar="MODEL", help="llava, llava_next, qwen2_5_vl, internvl (default: all)")
    eff.add_argument("--presets", nargs="+", metavar="PRESET", help="presets to compare (default: lightkv tome fastv pdrop)")
    eff.add_argument("--out", metavar="DIR", help="output folder (default: benchmarks/results, "
                     "benchmarks/results/quick with --quick)")
    eff.add_argument("--repeats", type=_depth, metavar="N", help="timed prefills per variant (default: 5; 3 with --quick)")
    eff.add_argument("--layers", type=_depth, metavar="N", help="reduced decoder depth (default: 8; 6 with --quick)")
    eff.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    eff.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                     help="default: float32 on CPU, bfloat16 on CUDA")
    eff.add_argument("--threads", type=_depth, metavar="N", help="torch CPU threads (default: torch's)")
    eff.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    eff.add_argument("--no-plots", action="store_true", help="write JSON and Markdown only")
    eff.add_argument("--no-progress", action="store_true", help="no progress bar")
    eff.set_defaults(func=_cmd_bench_efficiency)
    qual = bsub.add_parser(
        "quality",
        help="accuracy and fidelity vs kept vision KV with the bundled model, every method",
        description="Every method (preset) at kept vision-KV targets of about 100/75/55/40/25%, its schedule "
        "scaled to the model's depth, on held-out conversations (a question, then a follow-up about another "
        "region): exact match per question type, KL to the uncompressed answer distribution, log-probability "
        "drop, paired bootstrap intervals vs lightkv, an ablation table at 55%, realised kept fraction and vision "
        "KV bytes. Writes quality-<task>.json, .md, .png and quality-<task>-provenance.png.",
        formatter_class=fmt,
    )
    qual.add_argument("--episodes", type=_depth, default=600, metavar="N",
                      help="held-out conversations (default: 600)")
    qual.add_argument("--methods", nargs="+", metavar="PRESET", help="presets (default: all eight)")
    qual.add_argument("--targets", nargs="+", type=float, metavar="F", help="kept fractions (default: 1 .75 .55 .4 .25)")
    qual.add_argument("--model", metavar="NAME|DIR", default="digitgrid",
                      help="a bundled model (digitgrid) or a DigitGrid/SymbolGrid model directory (default: digitgrid)")
    qual.add_argument("--no-ablations", action="store_true", help="skip the ablation table")
    qual.add_argument("--no-followup", action="store_true", help="no follow-up questions")
    qual.add_argument("--batch", type=_depth, default=100, metavar="N", help="episodes per batch (default: 100)")
    qual.add_argument("--out", metavar="DIR", help="output folder (default: benchmarks/results)")
    qual.add_argument("--threads", type=_depth, metavar="N", help="torch CPU threads (default: torch's)")
    qual.set_defaults(func=_cmd_bench_quality)
    bench.set_defaults(func=lambda args: _missing_action(bench))

    gen = commands.add_parser(
        "generate",
        help="answer a prompt about an image with a compressed prefill (optionally vs uncompressed)",
        description="Load a supported transformers model and its processor (a local directory or a hub id), "
        "answer PROMPT about IMAGE with greedy decoding while a pipeline compresses the vision tokens of the "
        "prefill, and print the answer with a short report: kept vision fraction, vision and total KV bytes "
        "with and without compression, time to first token and generate time. --compare also generates "
        "without compression.",
        formatter_class=fmt,
    )
    gen.add_argument("--model", metavar="DIR|ID", default=None,
                     help="model directory (or hub id) with its processor (default: the bundled DigitGrid LVLM)")
    gen.add_argument("--image", metavar="FILE", default=None,
                     help="image file (any format Pillow reads; default with the bundled model: a held-out DigitGrid image)")
    gen.add_argument("--prompt", metavar="TEXT", default=None,
                     help="the question or instruction (default with the bundled model: a question about that image)")
    which = gen.add_mutually_exclusive_group()
    which.add_argument("--preset", metavar="NAME", help="a preset (see `lightkv presets`; default: lightkv-budget "
                       "with the bundled model, lightkv with --model)")
    which.add_argument("--config", metavar="FILE", help="a pipeline YAML file")
    gen.add_argument("--compare", action="store_true", help="also generate without compression and compare")
    gen.add_argument("--max-new-tokens", type=_depth, default=32, metavar="N", help="tokens to generate (default: 32)")
    gen.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                     help="default: float32 on CPU, bfloat16 on CUDA")
    gen.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    gen.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    gen.set_defaults(func=_cmd_generate)

    demo = commands.add_parser(
        "demo",
        help="the bundled DigitGrid LVLM answers held-out questions with and without LightKV "
             "(options: lightkv demo --help)",
        add_help=False,  # --help goes to the demo's own parser
    )
    demo.set_defaults(func=_cmd_demo)  # its arguments are forwarded untouched (see main)
    stages = commands.add_parser(
        "stages-demo",
        help="the pure core on a real image, no model needed (options: lightkv stages-demo --help)",
        add_help=False,
    )
    stages.set_defaults(func=_cmd_stages_demo)
    return parser


def _missing_action(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


# ---------------------------------------------------------------------------- commands
def _cmd_presets(args: argparse.Namespace) -> int:
    from .presets import PRESETS

    width = max(len(n) for n in PRESETS) + 2
    for name, preset in PRESETS.items():
        print(f"{name:<{width}}{preset.summary}")
        if args.verbose:
            wrap = textwrap.TextWrapper(width=92, initial_indent="    ", subsequent_indent="    ")
            print(wrap.fill(preset.description))
            if preset.source:
                print(wrap.fill(f"Source: {preset.source}"))
            print()
    return EXIT_OK


def _load(target: str):
    from .config import load_config

    try:
        return load_config(target)
    except FileNotFoundError as e:
        raise _UsageError(str(e).strip("'\"")) from None
    except IsADirectoryError as e:  # pragma: no cover - caught as FileNotFoundError above
        raise _UsageError(str(e)) from None
    except PermissionError as e:
        raise _UsageError(f"{target}: cannot read the file ({e.strerror})") from None
    except UnicodeDecodeError:
        raise _UsageError(f"{target}: not a text file") from None
    except ValueError as e:
        from .config import ConfigError

        if isinstance(e, ConfigError):
            raise
        raise _UsageError(str(e)) from None


def _plan_lines(cfg, num_layers: int, target: str) -> list[str]:
    from .config import ConfigError

    try:
        stages = cfg.validate_for_model(num_layers)
    except ConfigError as e:
        raise e.with_source(target) from None
    if not stages:
        return [f"on a {num_layers}-layer model: no stages (nothing is compressed)"]
    lines = [f"on a {num_layers}-layer model, {len(stages)} stage(s):"]
    for i, s in enumerate(stages):
        windows = (
            f"windows_per_side {s.windows_per_side}" if s.windows_per_side is not None
            else f"window_size {s.window_size[0]}x{s.window_size[1]}"  # type: ignore[index]
        )
        lines.append(f"  stage {i}: after layer {s.layer}, removal ratio {s.ratio:g}, {windows}")
    lines.append(f"vision KV kept on average over layers: {cfg.average_kept_fraction(num_layers):.1%}")
    return lines


def _cmd_show(args: argparse.Namespace) -> int:
    cfg = _load(args.target)
    plan = _plan_lines(cfg, args.num_layers, args.target) if args.num_layers else []
    if args.format == "json":
        print(json.dumps(cfg.to_dict(), indent=2, ensure_ascii=False))
        for line in plan:
            print(line, file=sys.stderr)
    else:
        sys.stdout.write(cfg.to_yaml())
        for line in plan:
            print(f"# {line}")
    return EXIT_OK


def _default_depth(cfg) -> int:
    layers = cfg.schedule.layers
    return max(32, layers[-1] + 1) if layers else 32


def _dry_run(cfg, num_layers: int, grid: tuple[int, int]) -> str:
    import torch

    from .graph import ImageSegment, VisionLayout

    pipe = cfg.build()
    scorers = [pipe.scorer] + [o.get("scorer") for o in pipe.stage_overrides.values()]
    if any(s is not None and getattr(s, "features", "hidden") == "keys" for s in scorers):
        return "dry run skipped: the edge scorer compares attention keys, which only a model provides"
    h, w = grid
    n = h * w + 16
    layout = VisionLayout.from_segments(1, n, [ImageSegment(row=0, offset=8, grid=(h, w))])
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, n, 32, generator=gen)
    relevance = torch.rand(1, n, generator=gen)
    results = pipe.run(hidden, layout, num_layers=num_layers, relevance=relevance)
    counts = [h * w] + [int(r.layout.vision_counts()[0]) for r in results]
    return f"dry run on one {h}x{w} image: " + " -> ".join(map(str, counts)) + " vision tokens"


def _cmd_validate(args: argparse.Namespace) -> int:
    cfg = _load(args.target)
    depth = args.num_layers or _default_depth(cfg)
    lines = _plan_lines(cfg, depth, args.target)
    if not args.num_layers:
        lines[0] += " (assumed; pass --num-layers for your model)"
    try:
        lines.append(_dry_run(cfg, depth, args.grid))
    except ValueError as e:
        print(f"{PROG}: error: {args.target}: dry run failed: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(f"{args.target}: valid pipeline {cfg.name!r}")
    for line in lines:
        print(f"  {line}")
    return EXIT_OK


def _cmd_schema(args: argparse.Namespace) -> int:
    from .config import json_schema

    print(json.dumps(json_schema(), indent=args.indent or None, ensure_ascii=False))
    return EXIT_OK


def _cmd_bench_quality(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .bench import quality as q
    from .presets import PRESETS

    unknown = [m for m in args.methods or () if m not in PRESETS]
    if unknown:
        raise _UsageError(f"unknown preset {unknown[0]!r}; choose from: {', '.join(sorted(PRESETS))}")
    bad = [t for t in args.targets or () if not 0.0 < t <= 1.0]
    if bad:
        raise _UsageError(f"--targets must be kept fractions in (0, 1], got {bad[0]}")
    cfg = q.AccuracyConfig(model=args.model, episodes=args.episodes, batch=args.batch, threads=args.threads,
                           ablations=not args.no_ablations, followup=not args.no_followup,
                           **({"methods": tuple(args.methods)} if args.methods else {}),
                           **({"targets": tuple(args.targets)} if args.targets else {}))
    try:
        result = q.run(cfg)
    except (FileNotFoundError, ValueError) as e:
        raise _UsageError(str(e).splitlines()[0]) from None
    out = Path(args.out) if args.out else q.RESULTS
    files = q.write_outputs(result, out, args.model)
    sys.stdout.write(q.markdown_table(result))
    for f in files:
        print(f"wrote {f}")
    return EXIT_OK


def _cmd_bench_efficiency(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from .bench import efficiency as eff

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    over = {k: v for k, v in {
        "models": tuple(args.models) if args.models else None,
        "presets": tuple(args.presets) if args.presets else None,
        "repeats": args.repeats, "layers": args.layers, "threads": args.threads,
    }.items() if v is not None}
    over.update(device=device, dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"),
                memory=not args.no_memory, progress=not args.no_progress)
    try:
        cfg = eff.quick_config(**over) if args.quick else eff.BenchConfig(**over)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    out = Path(args.out) if args.out else eff.RESULTS / ("quick" if args.quick else "")
    try:
        result = eff.run(cfg)
    except (ValueError, RuntimeError) as e:
        raise _UsageError(str(e).splitlines()[0]) from None
    files = eff.write_outputs(result, out, with_plots=not args.no_plots)
    sys.stdout.write(eff.markdown_table(result))
    for f in files:
        print(f"wrote {f}")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from .digitgrid.demo import main as demo_main

    return demo_main(args.forwarded) or EXIT_OK


def _cmd_stages_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(args.forwarded) or EXIT_OK


def _cmd_generate(args: argparse.Namespace) -> int:
    import logging

    import torch
    from transformers.utils import logging as hf_logging

    from . import generate as g
    from .config import ConfigError

    if args.preset and ("/" in args.preset or os.sep in args.preset or args.preset.endswith((".yaml", ".yml"))):
        raise _UsageError(f"--preset takes a preset name; use --config for the file {args.preset!r}")
    from .digitgrid.model import BUNDLED_MODEL

    bundled = args.model is None
    model_path = str(BUNDLED_MODEL) if bundled else args.model
    if not bundled and (args.image is None or args.prompt is None):
        raise _UsageError("--image and --prompt are required with --model (they default only for the bundled model)")
    if args.prompt is not None and not args.prompt.strip():
        raise _UsageError("--prompt is empty; give a question, or leave --prompt out for the bundled model's default")
    # the bundled model has 6 layers: the 32-layer 'lightkv' schedule does not fit it
    target = args.config if args.config else (args.preset or ("lightkv-budget" if bundled else "lightkv"))
    cfg = _load(target)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    hub_log = logging.getLogger("huggingface_hub")
    hub_level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # no network: one error line, not a warning per retry
    quiet = not sys.stderr.isatty() and hf_logging.is_progress_bar_enabled()
    if quiet:  # keep piped stderr to the one-line errors
        hf_logging.disable_progress_bar()
    try:
        prompt = args.prompt
        if args.image is not None:
            image = g.load_image(args.image)  # before loading a possibly large model
        else:
            image, question = _digitgrid_example()
            print(f"image: a held-out DigitGrid image ({question['grid']})")
            prompt = prompt or question["question"]
            print(f"prompt: {prompt!r} (expected answer: {question['answer']!r})")
        loaded = g.load_model(model_path, dtype=dtype, device=device, check=cfg)
        inputs = g.build_inputs(loaded, image, prompt)
        result = g.run(loaded, inputs, cfg.build(), compare=args.compare, max_new_tokens=args.max_new_tokens)
    except g.GenerateError as e:
        raise _UsageError(str(e)) from None
    except ConfigError as e:  # e.g. a schedule deeper than the model: name the file or preset
        raise (e if e.source else e.with_source(target if args.config else f"preset {target}")) from None
    finally:
        hub_log.setLevel(hub_level)
        if quiet:
            hf_logging.enable_progress_bar()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(result.format())
    return EXIT_OK


def _digitgrid_example():
    """A held-out DigitGrid image (PIL) and a cell question about it, for the bundled model."""
    import random

    from .digitgrid import data
    from .digitgrid.model import BUNDLED_MODEL, read_grid_config

    grid = read_grid_config(BUNDLED_MODEL)
    ep = data.make_episode(random.Random("generate-example"), "heldout", "what", grid)
    cells = " / ".join(" ".join("." if v < 0 else str(v) for v in row) for row in ep.grid.tolist())
    return data.to_pil(ep.image), {"question": " ".join(ep.question), "answer": " ".join(ep.answer),
                                   "grid": f"cells by row: {cells}"}


# ---------------------------------------------------------------------------- entry point
def parse_args(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse a command line as `main` does (raises SystemExit on --help or a usage error).

    ``lightkv demo`` and ``lightkv stages-demo`` forward their options to the demos' own
    parsers (`lightkv.digitgrid.demo.build_parser`, `lightkv.demo.build_parser`).
    """
    parser = parser or build_parser()
    args, forwarded = parser.parse_known_args(argv)
    if getattr(args, "func", None) is _cmd_demo:
        from .digitgrid.demo import build_parser as demo_parser

        demo_parser(f"{PROG} demo").parse_args(forwarded)  # validates (and serves --help)
    elif getattr(args, "func", None) is _cmd_stages_demo:
        from .demo import build_parser as stages_parser

        stages_parser(f"{PROG} stages-demo").parse_args(forwarded)
    elif forwarded:
        parser.parse_args(argv)  # argparse's own error for unknown arguments
    args.forwarded = forwarded
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 invalid config, 2 usage)."""
    parser = build_parser()
    try:
        args = parse_args(argv, parser)
    except SystemExit as e:  # --help, --version, usage errors
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from .config import ConfigError

    try:
        return args.func(args)
    except _UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"{PROG}: error: {line}", file=sys.stderr)
        return EXIT_INVALID
    except ModuleNotFoundError as e:  # an optional dependency: name the extra that brings it
        extra = _EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"{PROG}: error: this command needs {e.name}, which is not installed: pip install 'lightkv[{extra}]'",
              file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `lightkv config schema | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
