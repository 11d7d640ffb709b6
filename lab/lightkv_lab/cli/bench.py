"""The commands of ``lightkv bench``: efficiency, scaling, kvquant, quality and ablation (their
options and limits: `lightkv_lab.cli.bench_args`); memory (`lightkv_lab.cli.bench_memory`)."""

from __future__ import annotations

import argparse
import sys

from lightkv.cli.common import (
    EXIT_OK,
    UsageError,
    missing_action,
    physical_memory,
    require,
    writable_dir,
)
from lightkv.cli.lists import MAX_NAMES, MAX_NUMBERS, merged
from lightkv_lab.cli.bench_args import add_parsers
from lightkv_lab.cli.bench_memory import cmd_bench_memory

__all__ = ["add_commands"]


def _check_memory(cfg) -> None:
    """Refuse, before building anything, a decoder whose weights alone would not fit here."""
    from lightkv_lab.bench import efficiency as eff

    have = physical_memory()
    element = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    full = cfg.width == "full"
    need = max(eff.MODELS[m].weight_bytes(cfg.layers, cfg.heads, full, element) for m in cfg.models)
    if have and cfg.device == "cpu" and need > 0.8 * have:
        per_layer = need / cfg.layers
        raise UsageError(
            f"--layers {cfg.layers} at --width {cfg.width} needs about {need / 2**30:.1f} GiB of "
            f"weights ({per_layer / 2**30:.2f} GiB a layer) and this machine has "
            f"{have / 2**30:.1f} GiB: use --layers {max(2, int(0.8 * have // per_layer))} or fewer"
        )


def add_commands(commands) -> None:
    """Add ``bench`` and its benchmarks to the top-level subparsers (their options:
    `lightkv_lab.cli.bench_args`)."""
    parsers = add_parsers(commands)
    for name, func in {
        "efficiency": _cmd_bench_efficiency,
        "scaling": _cmd_bench_scaling,
        "kvquant": _cmd_bench_kvquant,
        "quality": _cmd_bench_quality,
        "ablation": _cmd_bench_ablation,
        "memory": cmd_bench_memory,
    }.items():
        parsers[name].set_defaults(func=func)
    bench = parsers["bench"]
    bench.set_defaults(func=lambda args: missing_action(bench))


def _kept_fractions(values, option: str):
    """``values`` merged (`merged`) and in the one range every benchmark takes
    (`lightkv_lab.bench.budgets.check_kept_fractions`), or None when not given."""
    from lightkv_lab.bench.budgets import check_kept_fractions

    values = merged(values, option, MAX_NUMBERS)
    if values is None:
        return None
    try:
        return check_kept_fractions(values, option)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _cmd_bench_quality(args: argparse.Namespace) -> int:
    from pathlib import Path

    require("matplotlib", why="for its plots")
    from lightkv.presets import PRESETS
    from lightkv_lab.bench import quality as q
    from lightkv_lab.bench import quality_report as report

    args.methods = merged(args.methods, "--methods", MAX_NAMES)
    from lightkv_lab.bench.budgets import VARIANTS

    unknown = [m for m in args.methods or () if m not in PRESETS and m not in VARIANTS]
    if unknown:
        raise UsageError(
            f"unknown preset {unknown[0]!r}; choose from: {', '.join(sorted(PRESETS))} "
            f"(or a benchmark variant: {', '.join(VARIANTS)})"
        )
    args.targets = _kept_fractions(args.targets, "--kept-fractions")
    args.ablation_targets = _kept_fractions(args.ablation_targets, "--ablation-kept-fractions")
    cfg = q.AccuracyConfig(
        model=args.model,
        episodes=args.episodes,
        batch=args.batch,
        threads=args.threads,
        ablations=not args.no_ablations,
        followup=not args.no_followup,
        seed=args.seed,
        # the relevance table needs no more questions than the run asks (--episodes 2 is quick)
        relevance_episodes=min(q.AccuracyConfig.relevance_episodes, args.episodes),
        baseline=args.baseline,
        **({"methods": tuple(args.methods)} if args.methods else {}),
        **({"targets": tuple(args.targets)} if args.targets else {}),
        **({"ablation_targets": tuple(args.ablation_targets)} if args.ablation_targets else {}),
    )
    try:
        q.comparator(cfg)  # a --baseline outside --methods: before any work
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = writable_dir(Path(args.out) if args.out else q.RESULTS)
    try:
        result = q.run(cfg, progress=not args.quiet)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e).splitlines()[0]) from None
    files = report.write_outputs(result, out, args.model)
    sys.stdout.write(report.markdown_table(result))
    for f in files:
        print(f"wrote {f}")
    return EXIT_OK


def _cmd_bench_ablation(args: argparse.Namespace) -> int:
    from pathlib import Path

    require("matplotlib", why="for its plots")
    from lightkv.presets import PRESETS
    from lightkv_lab.bench import ablation as ab
    from lightkv_lab.bench.quality import RESULTS

    args.models = merged(args.models, "--models", MAX_NAMES)
    args.baselines = merged(args.baselines, "--baselines", MAX_NAMES)
    args.variants = merged(args.variants, "--variants", MAX_NAMES)
    unknown = [m for m in args.baselines or () if m not in PRESETS]
    if unknown:
        raise UsageError(
            f"unknown preset {unknown[0]!r}; choose from: {', '.join(sorted(PRESETS))}"
        )
    bad = [v for v in args.variants or () if v not in ab.VARIANTS]
    if bad:
        raise UsageError(f"unknown variant {bad[0]!r}; choose from: {', '.join(ab.VARIANTS)}")
    args.targets = _kept_fractions(args.targets, "--kept-fractions")
    given = {
        "models": args.models,
        "targets": args.targets,
        "variants": args.variants,
        "baselines": args.baselines,
    }
    cfg = ab.AblationConfig(
        episodes=args.episodes, threads=args.threads, **{k: tuple(v) for k, v in given.items() if v}
    )
    out = writable_dir(Path(args.out) if args.out else RESULTS)
    try:
        result = ab.run(cfg, progress=not args.quiet)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e).splitlines()[0]) from None
    files = ab.write_outputs(result, out)
    sys.stdout.write(ab.markdown_table(result))
    for f in files:
        print(f"wrote {f}")
    return EXIT_OK


def _cmd_bench_efficiency(args: argparse.Namespace) -> int:
    from pathlib import Path

    if not args.no_plots:
        require("matplotlib", why="for its plots (or pass --no-plots)")
    import torch

    from lightkv_lab.bench import efficiency as eff

    args.models = merged(args.models, "--models", MAX_NAMES)
    args.presets = merged(args.presets, "--presets", MAX_NAMES)
    args.budgets = _kept_fractions(args.budgets, "--kept-fractions")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    over = {
        k: v
        for k, v in {
            "models": tuple(args.models) if args.models else None,
            "presets": tuple(args.presets) if args.presets else None,
            "budgets": tuple(args.budgets) if args.budgets else None,
            "repeats": args.repeats,
            "layers": args.layers,
            "threads": args.threads,
            "width": args.width,
            "heads": args.heads,
        }.items()
        if v is not None
    }
    if args.projection_baseline:
        over["projection_baseline"] = True
    if args.no_eager_reference:
        over["eager_reference"] = False
    over.update(
        device=device,
        dtype=args.dtype or ("bfloat16" if device == "cuda" else "float32"),
        memory=not args.no_memory,
        progress=not args.quiet,
        attn_implementation=args.attn_implementation,
        allocator=args.allocator,
    )
    try:
        cfg = eff.quick_config(**over) if args.quick else eff.BenchConfig(**over)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_memory(cfg)
    out = writable_dir(
        Path(args.out) if args.out else eff.RESULTS / ("quick" if args.quick else "")
    )
    try:
        result = eff.run(cfg)
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e).splitlines()[0]) from None
    files = eff.write_outputs(result, out, with_plots=not args.no_plots)
    sys.stdout.write(eff.markdown_table(result))
    for f in files:
        print(f"wrote {f}")
    return EXIT_OK


def _cmd_bench_scaling(args: argparse.Namespace) -> int:
    from pathlib import Path

    if not args.no_plots:
        require("matplotlib", why="for its plot (or pass --no-plots)")
    from lightkv_lab.bench.efficiency import RESULTS
    from lightkv_lab.bench.efficiency import scaling as sc

    args.sides = merged(args.sides, "--sides", MAX_NUMBERS)
    over = {
        k: v
        for k, v in {
            "sides": tuple(args.sides) if args.sides else None,
            "width": args.width,
            "heads": args.heads,
            "layers": args.layers,
            "repeats": args.repeats,
            "threads": args.threads,
        }.items()
        if v is not None
    }
    if args.no_prefill:
        over["prefill"] = False
    out = writable_dir(Path(args.out) if args.out else RESULTS / ("quick" if args.quick else ""))
    try:
        cfg = sc.quick_scaling(**over) if args.quick else sc.ScalingConfig(**over)
        result = sc.run_scaling(cfg)
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0]) from None
    files = sc.write_scaling(result, out, with_plots=not args.no_plots)
    sys.stdout.write(sc.scaling_markdown(result))
    for f in files:
        print(f"wrote {f}")
    return EXIT_OK


def _cmd_bench_kvquant(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from lightkv_lab.bench.efficiency import RESULTS
    from lightkv_lab.bench.efficiency import kvquant as kq

    args.models = merged(args.models, "--models", MAX_NAMES)
    args.backends = merged(args.backends, "--backends", MAX_NAMES)
    from lightkv.outputs import write_atomic

    over = {
        k: v
        for k, v in {
            "models": tuple(args.models) if args.models else None,
            "backends": tuple(args.backends) if args.backends else None,
            "layers": args.layers,
        }.items()
        if v is not None
    }
    out = writable_dir(Path(args.out) if args.out else RESULTS)
    try:
        result = kq.run_kvquant(kq.KVQuantConfig(**over))
    except ValueError as e:
        raise UsageError(str(e).splitlines()[0]) from None
    texts = {
        "kv-quantization.json": json.dumps(result, indent=2) + "\n",
        "kv-quantization.md": kq.kvquant_markdown(result),
    }
    for name, text in texts.items():  # both rendered before either is written
        write_atomic(out / name, text)
    sys.stdout.write(kq.kvquant_markdown(result))
    print(f"wrote {out / 'kv-quantization.json'}\nwrote {out / 'kv-quantization.md'}")
    return EXIT_OK
