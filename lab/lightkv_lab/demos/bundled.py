"""``lightkv demo``: a bundled LVLM answers held-out questions with and without LightKV.

Loads a model shipped in the package (`lightkv_lab.tasks.model.BUNDLED_MODELS`, offline;
default ``scenes``, the Scenes-VQA model whose images have natural-image token statistics)
or a model directory written by the trainer, asks held-out questions of every type and
answers each twice: uncompressed, then with a pipeline (default ``lightkv-budget``: LightKV
at 55% of the vision KV cache, stages placed for this model's depth). Prints one row per
question (answer, correct?, kept vision fraction, vision KV bytes and prefill time, both
compressed / uncompressed); then, on a fixed set of held-out questions, how many LightKV,
lightkv-cover (lightkv's method for low budgets) and each of `CONTRAST_METHODS` get right
at 55% kept and at a low budget (``--low``, 25% by default), where methods separate, each
with LightKV minus the method and its paired bootstrap 95% interval, one question that
LightKV answers right and another method wrong, and one where it is the other way round;
and writes a picture of lightkv's prompt relevance over the asked object and of which
tokens merged into which.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

__all__ = ["build_parser", "main"]

MAX_QUESTIONS = 200
MAX_CONTRAST = 2000
"""Limits that keep the demo within about a minute (questions) and ten (contrast) on 2 cores."""


def build_parser(prog: str = "lightkv demo") -> argparse.ArgumentParser:
    """The demo's command-line options."""
    from lightkv.presets import PRESETS

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument(
        "--model",
        default="scenes",
        help="a bundled model (scenes, photos, digitgrid, symbolgrid) or a model directory written "
        "by the trainer (default: scenes)",
    )
    p.add_argument(
        "--preset",
        default="lightkv-budget",
        choices=sorted(PRESETS),
        help="pipeline to compare with the uncompressed model (default: lightkv-budget)",
    )
    p.add_argument("--questions", type=int, default=8, help="held-out questions to ask (default 8)")
    p.add_argument("--seed", type=int, default=7, help="which held-out episodes (default 7)")
    p.add_argument(
        "--contrast",
        type=int,
        default=100,
        metavar="N",
        help="held-out questions every method answers at 55%% and at --low kept (0: skip; at most "
        f"{MAX_CONTRAST})",
    )
    p.add_argument(
        "--low",
        type=float,
        default=0.25,
        metavar="F",
        help="the low kept fraction of the method comparison (default 0.25)",
    )
    p.add_argument(
        "--out", default=".", help="directory for lightkv-demo-provenance.png (default: .)"
    )
    p.add_argument("--no-png", action="store_true", help="do not write the provenance picture")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar for the comparison (none either when not a terminal)",
    )
    return p


def _prefill_ms(model, inputs, session=None, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if session is None:
            model(**inputs)
        else:
            with session:
                model(**inputs)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    """Run the demo; ``argv`` as on the command line."""
    from lightkv.adapters import apply
    from lightkv.outputs import output_dir_problem
    from lightkv.presets import get_preset
    from lightkv_lab.bench.provenance import provenance_picture
    from lightkv_lab.tasks import evaluate
    from lightkv_lab.tasks import model as dg

    args = build_parser().parse_args(argv)
    if not 1 <= args.questions <= MAX_QUESTIONS or not 0 <= args.contrast <= MAX_CONTRAST:
        print(
            f"lightkv demo: --questions must be in [1, {MAX_QUESTIONS}] and --contrast in [0, "
            f"{MAX_CONTRAST}] (about 0.3 s per question, 0.1 s per contrast question and method on "
            "2 cores)",
            file=sys.stderr,
        )
        return 2
    if not 0.0 < args.low < 1.0:
        print(
            f"lightkv demo: --low must be a kept fraction in (0, 1), got {args.low}",
            file=sys.stderr,
        )
        return 2
    if not args.no_png and importlib.util.find_spec("matplotlib") is None:
        print(
            "lightkv demo: the picture needs matplotlib, which is not installed: pip install "
            "matplotlib (or pass --no-png)",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    problem = (
        None if args.no_png else output_dir_problem(out)
    )  # before any work, not after a minute of it
    if problem:
        print(
            f"lightkv demo: --out {out}: {problem}; give a writable directory for "
            "lightkv-demo-provenance.png (or --no-png)",
            file=sys.stderr,
        )
        return 2
    path = dg.resolve_model(args.model)
    try:
        model, _, grid = dg.load(path)
        data = dg.read_task(path).data
    except (FileNotFoundError, OSError, ValueError) as e:
        print(
            f"lightkv demo: cannot load the model from {path}: {str(e).splitlines()[0]}",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    pipe = get_preset(args.preset)
    num_layers = model.config.text_config.num_hidden_layers
    try:
        session = apply(pipe, model)
    except ValueError as e:
        print(
            f"lightkv demo: preset {args.preset!r} does not fit this {num_layers}-layer model: {e}",
            file=sys.stderr,
        )
        return 2
    episodes = evaluate.heldout_episodes(args.questions, seed=args.seed, grid=grid)
    n_img = data.num_image_tokens(grid, model.config.vision_config.patch_size)
    print(
        f"model: {path} ({num_layers} decoder layers, {n_img} vision tokens per image, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)"
    )
    print(
        f"pipeline: {args.preset} ({pipe.scheduler.__class__.__name__}); held-out episodes, seed "
        f"{args.seed}\n"
    )
    w = 18 if data.__name__.endswith("digitgrid.data") else 26
    head = (
        f"{'question':{QUESTION_WIDTH}s} {'truth':{w}s} {'uncompressed':{w}s} {args.preset:{w}s} "
        f"{'kept':>5s} {'vision KV':>17s} {'prefill ms':>13s}"
    )
    print(f"{'':{QUESTION_WIDTH + 3 * (w + 1)}s} {'':5s} {'comp/uncomp':>17s} {'comp/uncomp':>13s}")
    print(head)
    print("-" * len(head))
    right = [0, 0]
    for ep in episodes:
        base = evaluate.answer(model, [ep], grid)[0]
        with session:
            got = evaluate.answer(model, [ep], grid)[0]
        rep = session.report()
        inputs = data.collate_prompts([ep], n_img)  # the task's own collation
        t_base, t_comp = _prefill_ms(model, inputs), _prefill_ms(model, inputs, session)
        ok = [base == ep.answer, got == ep.answer]
        right = [r + o for r, o in zip(right, ok)]
        mark = ["ok" if o else "WRONG" for o in ok]
        kv = f"{rep.kv_bytes_vision / 1024:.0f}/{rep.kv_bytes_vision_baseline / 1024:.0f} KiB"
        question = _question_lines(ep.question)
        print(
            f"{question[0]:{QUESTION_WIDTH}s} {_short(ep.answer, w)} "
            f"{_short(base, w, mark[0])} {_short(got, w, mark[1])} "
            f"{rep.kept_vision_fraction:5.2f} {kv:>17s} {t_comp:6.1f}/{t_base:<6.1f}"
        )
        for more in question[1:]:  # a long question wraps inside its own column
            print(more)
    n = len(episodes)
    print(
        f"\ncorrect: {right[0]}/{n} uncompressed, {right[1]}/{n} with {args.preset} (vision KV "
        "and prefill both compressed/uncompressed; KV summed over layers, prefill the median of 3; "
        "on a model this small the hooks cost more than the layers they shorten)"
    )
    if args.contrast:
        from lightkv_lab.bench.progress import Progress
        from lightkv_lab.tasks.tower_memo import TowerMemo

        targets = (0.55, args.low)
        # the frozen tower runs once per batch of the contrast questions, not once per method
        with (
            Progress(len(targets) * len(METHODS), "lightkv demo", quiet=args.quiet) as bar,
            TowerMemo(model),
        ):
            for target in targets:
                _contrast(model, grid, num_layers, args, target, bar)
    if not args.no_png:
        out.mkdir(parents=True, exist_ok=True)
        target = out / "lightkv-demo-provenance.png"
        drawn = provenance_picture(target, str(path))
        print(
            f"\nwrote {target}: '{drawn['question']}' (answer {drawn['answer']}): the image, "
            f"lightkv's prompt relevance ({drawn['relevance_share_asked']:.0%} on the asked "
            f"{drawn['asked']}, which is {drawn['asked_area']:.1%} of the image), and which "
            "patches merged into which token with lightkv and with prompt-agnostic ToMe"
        )
    return 0


QUESTION_WIDTH = 30
"""The question column: a longer question wraps onto lines of its own below the row, quoted,
so it never runs into the truth column ('where is the red object the yellow object' and its
answer 'right' once read as one sentence)."""


def _question_lines(words: list[str]) -> list[str]:
    """The question in quotes, wrapped to `QUESTION_WIDTH` (continuation lines indented)."""
    import textwrap

    return textwrap.wrap(f"'{' '.join(words)}'", QUESTION_WIDTH, subsequent_indent=" ") or ["''"]


def _short(words: list[str], width: int, mark: str | None = None) -> str:
    text = " ".join(words) + ("" if mark is None else f" {mark}")
    return (text if len(text) <= width else text[: width - 3] + "...").ljust(width)


CONTRAST_METHODS = ("tome", "fastv", "pdrop", "random", "divprune")
"""Compared with lightkv: ToMe, the attention-ranked dropping methods, random dropping, and
DivPrune (the set selection that wins at the lowest budgets, where LightKV loses)."""
METHODS = ("lightkv", "lightkv-cover", *CONTRAST_METHODS)
"""The comparison's rows: LightKV (the comparator of the intervals), lightkv-cover (lightkv's
method for budgets below LightKV's reach) and `CONTRAST_METHODS`; the quality benchmark's
results page has every method (`lightkv bench quality`)."""


def _contrast(model, grid, num_layers: int, args, target: float, bar) -> None:
    """How many of ``args.contrast`` held-out questions (seed ``args.seed + 1``) each of
    `METHODS` answers right at ``target`` kept (schedules as the quality benchmark builds
    them), with lightkv minus the method and its paired bootstrap 95% interval (points; the
    quality benchmark's `lightkv_lab.tasks.scoring.paired_bootstrap`), and the first question
    lightkv gets right and another wrong, and the other way round. ``bar`` steps once per
    method (`lightkv_lab.bench.progress.Progress`)."""
    from lightkv.adapters import apply
    from lightkv_lab.bench.budgets import knob_pipeline
    from lightkv_lab.tasks import evaluate, scoring

    convs = scoring.conversations(args.contrast, grid, seed=args.seed + 1, followup=False)
    pipes = {m: knob_pipeline(m, num_layers, target)[0] for m in METHODS}
    scores = {}
    for m in METHODS:
        scores[m] = scoring.score(model, convs, grid, pipes[m], batch=50)
        bar.step(f"{m} at {target:.0%}")
    light = scores["lightkv"].correct
    print(
        f"\nat {target:.0%} of the vision KV cache, right out of {len(convs)} held-out questions "
        "(kept fraction; lightkv minus the method in points, paired bootstrap 95% interval):"
    )
    for m, s in scores.items():
        line = f"  {m:14s} {int(s.correct.sum()):4d} ({s.kept_fraction:.0%} kept)"
        if m != "lightkv":
            d, lo, hi = (100 * v for v in scoring.paired_bootstrap(light, s.correct, seed=0))
            line += f"  {d:+5.1f} [{lo:+.1f}, {hi:+.1f}]"
        print(line)
    others = METHODS[1:]
    wins = [
        i for i in range(len(convs)) if light[i] and any(not scores[m].correct[i] for m in others)
    ]
    losses = [
        i for i in range(len(convs)) if not light[i] and any(scores[m].correct[i] for m in others)
    ]
    if not wins and not losses:
        print("  on these questions every method that answers, answers as lightkv does")
        return
    for label, found in (
        ("lightkv right, another wrong", wins),
        ("lightkv wrong, another right", losses),
    ):
        if not found:
            continue
        ep = convs[found[0]].first
        line = []
        for m in METHODS:
            with apply(pipes[m], model):
                got = evaluate.answer(model, [ep], grid)[0]
            line.append(f"{m} '{' '.join(got)}'{'' if got == ep.answer else ' WRONG'}")
        print(f"  {label}: '{' '.join(ep.question)}' -> {' '.join(ep.answer)}: " + ", ".join(line))


if __name__ == "__main__":
    sys.exit(main())
