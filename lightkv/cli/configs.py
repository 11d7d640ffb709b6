"""``lightkv presets`` and ``lightkv config show|validate|schema``."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import replace

from .common import (
    EXIT_INVALID,
    EXIT_OK,
    PROG,
    Parser,
    at_kept_fraction,
    depth,
    grid,
    kept_fraction,
    load_config_or_preset,
    missing_action,
)

__all__ = ["add_commands"]

KEPT = "vision KV kept on average over layers: "
"""How the plan's and the dry run's kept fraction start (the headline of ``validate``)."""


def add_commands(commands) -> None:
    """Add ``presets`` and ``config`` to the top-level subparsers."""
    fmt = argparse.HelpFormatter
    p = commands.add_parser(
        "presets",
        help="list the shipped presets with one-line descriptions",
        description="List the shipped presets: LightKV with per-model schedules, and baselines "
        "(FastV, ToMe, PyramidDrop, pooling, random) built from the same policies.",
        formatter_class=fmt,
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="also print each description and source"
    )
    p.set_defaults(func=_cmd_presets)

    cfg = commands.add_parser(
        "config",
        help="show, validate or describe pipeline configurations",
        description="Work with pipeline configurations: presets by name or YAML files by path.",
        formatter_class=fmt,
    )
    sub = cfg.add_subparsers(
        dest="config_command", metavar="ACTION", title="actions", parser_class=Parser
    )
    target_help = "a preset name (see `lightkv presets`) or a YAML file"
    knob_help = (
        "T: the pipeline at this kept vision-KV fraction in (0, 1] on the model's depth "
        "(sets its kept_fraction; `lightkv presets -v` says what it moves)"
    )
    depth_help = (
        "decoder depth of the target model: check the schedule against it and show its stages"
    )

    show = sub.add_parser(
        "show",
        help="print a preset or file as canonical YAML",
        description="Print a pipeline as canonical YAML (a good starting point for your own file).",
        formatter_class=fmt,
    )
    show.add_argument("target", metavar="NAME|FILE", help=target_help)
    show.add_argument("--num-layers", type=depth, metavar="N", help=depth_help)
    show.add_argument(
        "--format", choices=("yaml", "json"), default="yaml", help="output format (default: yaml)"
    )
    show.add_argument("--kept-fraction", type=kept_fraction, metavar="T", help=knob_help)
    show.set_defaults(func=_cmd_show)

    val = sub.add_parser(
        "validate",
        help="check a pipeline file and dry-run it on a synthetic image",
        description="Validate a pipeline file: its fields, policy names and parameters, the "
        "schedule against a model depth, and a dry run on random hidden states.",
        formatter_class=fmt,
    )
    val.add_argument("target", metavar="FILE", help="a YAML file (or a preset name)")
    val.add_argument("--num-layers", type=depth, metavar="N", help=depth_help + " (default: 32)")
    val.add_argument(
        "--grid",
        type=grid,
        default=(24, 24),
        metavar="HxW",
        help="image grid of the dry run (default: 24x24)",
    )
    val.add_argument("--kept-fraction", type=kept_fraction, metavar="T", help=knob_help)
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
    cfg.set_defaults(func=lambda args: missing_action(cfg))


def _cmd_presets(args: argparse.Namespace) -> int:
    from ..presets import PRESETS

    width = max(len(n) for n in PRESETS) + 2
    for name, preset in PRESETS.items():
        print(f"{name:<{width}}{preset.summary}")
        if args.verbose:
            wrap = textwrap.TextWrapper(width=92, initial_indent="    ", subsequent_indent="    ")
            print(wrap.fill(preset.description))
            if preset.source:
                print(wrap.fill(f"Source: {preset.source}"))
            print(wrap.fill(f"kept_fraction moves: {preset.build().knob()}"))
            print()
    return EXIT_OK


def _plan_lines(cfg, num_layers: int, target: str) -> list[str]:
    from ..config import ConfigError

    try:
        stages = cfg.validate_for_model(num_layers)
    except ConfigError as e:
        raise e.with_source(target) from None
    model = f"on a {num_layers}-layer model"
    if cfg.kept_fraction is not None:
        model += f" at kept_fraction {cfg.kept_fraction:g}"
    if not stages and cfg.mode is not None:
        pipe = cfg.build()
        kept = pipe.target_kept_fraction(num_layers)
        promise = "" if kept is None else f"; vision KV kept on average over layers: {kept:.1%}"
        return [f"{model}: no stages; mode {pipe.mode_at(num_layers)!r} does the work{promise}"]
    if not stages:
        return [f"{model}: no stages (nothing is compressed)"]
    lines = [f"{model}, {len(stages)} stage(s):"]
    for i, s in enumerate(stages):
        windows = (
            f"windows_per_side {s.windows_per_side}"
            if s.windows_per_side is not None
            else f"window_size {s.window_size[0]}x{s.window_size[1]}"  # type: ignore[index]
        )
        where = (
            "before layer 0 (pre-LLM)"
            if s.mode == "pre_llm"
            else f"on layer {s.layer}'s cache"
            if s.mode == "cache"
            else f"after layer {s.layer}"
        )
        lines.append(f"  stage {i}: {where}, removal ratio {s.removal_ratio:g}, {windows}")
    lines.append(f"{KEPT}{cfg.average_kept_fraction(num_layers):.1%}")
    return lines


def _cmd_show(args: argparse.Namespace) -> int:
    cfg = at_kept_fraction(load_config_or_preset(args.target), args.kept_fraction)
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
    layers = None if cfg.schedule is None else cfg.schedule.layers
    return max(32, layers[-1] + 1) if layers else 32


def _dry_run(cfg, num_layers: int, grid: tuple[int, int]) -> tuple[list[str], float | None]:
    """The dry run's lines (what it kept; a stage that removed less than its ratio, flagged)
    and the vision-KV fraction it kept on average over layers (None: no dry run)."""
    import torch

    from ..graph import ImageSegment, VisionLayout
    from ..policies.schedulers import TARGET_TOLERANCE, average_kept_fraction

    pipe = cfg.build()
    h, w = grid
    n = h * w + 16
    layout = VisionLayout.from_segments(1, n, [ImageSegment(row=0, offset=8, grid=(h, w))])
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, n, 32, generator=gen)
    relevance = torch.rand(1, n, generator=gen)
    key_states = torch.randn(1, n, 2, 16, generator=gen)  # for key-space policies: 2 heads of 16
    stages = pipe.stages(num_layers)
    if not stages and pipe.mode is not None:
        return [
            f"no dry run: mode {pipe.mode.name!r} works on a model's cache (lightkv.apply)"
        ], None
    if stages and all(s.spec.mode == "cache" for s in stages):
        # the cache mode: each layer's cache on its own, from the whole image
        from ..cache_stage import CacheStage

        cache = key_states.transpose(1, 2)  # [B, H_kv, N, d]
        outs = [
            int(CacheStage(s)(cache, cache, layout, relevance).result.layout.vision_counts()[0])
            for s in stages
        ]
        ins = [h * w] * len(stages)
        kept = " or ".join(map(str, sorted(set(outs))))
        lines = [
            f"dry run on one {h}x{w} image: each of the {len(stages)} compressed layers' caches "
            f"keeps {kept} of {h * w} vision tokens"
        ]
    else:
        results = pipe.run(
            hidden, layout, num_layers=num_layers, relevance=relevance, key_states=key_states
        )
        counts = [h * w] + [int(r.layout.vision_counts()[0]) for r in results]
        ins, outs = counts[:-1], counts[1:]
        lines = [
            f"dry run on one {h}x{w} image: " + " -> ".join(map(str, counts)) + " vision tokens"
        ]
    done = [
        replace(s.spec, removal_ratio=1.0 - b / a if a else 0.0)
        for s, a, b in zip(stages, ins, outs)
    ]
    for i, (s, d) in enumerate(zip(stages, done)):
        if s.spec.removal_ratio - d.removal_ratio > TARGET_TOLERANCE:
            lines.append(
                f"  stage {i} removed {d.removal_ratio:.1%} of its {ins[i]} vision tokens, not "
                f"{s.spec.removal_ratio:.1%}: its policies cannot remove that much here (a "
                "parity split removes at most half a window; a window too small to split keeps all)"
            )
    return lines, average_kept_fraction(done, num_layers)


def _cmd_validate(args: argparse.Namespace) -> int:
    from ..policies.schedulers import TARGET_TOLERANCE

    cfg = at_kept_fraction(load_config_or_preset(args.target), args.kept_fraction)
    depth = args.num_layers or _default_depth(cfg)
    lines = _plan_lines(cfg, depth, args.target)
    if not args.num_layers:
        lines[0] += " (assumed; pass --num-layers for your model)"
    try:
        dry, kept = _dry_run(cfg, depth, args.grid)
    except ValueError as e:
        print(f"{PROG}: error: {args.target}: dry run failed: {e}", file=sys.stderr)
        return EXIT_INVALID
    analytic = next((i for i, line in enumerate(lines) if line.startswith(KEPT)), None)
    if kept is not None and analytic is not None:
        planned = cfg.average_kept_fraction(depth)
        if f"{kept:.1%}" != f"{planned:.1%}":  # the headline is what the dry run kept
            lines[analytic] = (
                f"{KEPT}{kept:.1%} in the dry run (the schedule's ratios: {planned:.1%}"
                + (", target missed)" if abs(kept - planned) > TARGET_TOLERANCE else ")")
            )
    print(f"{args.target}: valid pipeline {cfg.name!r}")
    for line in lines + dry:
        print(f"  {line}")
    return EXIT_OK


def _cmd_schema(args: argparse.Namespace) -> int:
    from ..config import json_schema

    print(json.dumps(json_schema(), indent=args.indent or None, ensure_ascii=False))
    return EXIT_OK
