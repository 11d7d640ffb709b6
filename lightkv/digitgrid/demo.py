"""``lightkv demo``: a bundled LVLM answers held-out questions with and without LightKV.

Loads a model shipped in the package (`lightkv.digitgrid.model.BUNDLED_MODELS`, offline;
default ``symbolgrid``, whose answers sit in single vision tokens) or a model directory written by the trainer, renders a few held-out
images, asks one question of each type about them and answers each twice: uncompressed,
then with a pipeline (default ``lightkv-budget``: LightKV at 55% of the vision KV cache,
stages placed for this model's depth). Prints one row per question (answer, correct?, kept
vision fraction, vision KV bytes, prefill time), then, from a fixed list of held-out
questions, the first one that LightKV answers right and ToMe or random merging at the same
budget gets wrong (if there is one), and writes a picture of which tokens merged into which
for a cell question.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

__all__ = ["build_parser", "main"]


def build_parser(prog: str = "lightkv demo") -> argparse.ArgumentParser:
    """The demo's command-line options."""
    from ..presets import PRESETS

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--model", default="symbolgrid",
                   help="a bundled model (symbolgrid, digitgrid) or a model directory written by the trainer "
                   "(default: symbolgrid)")
    p.add_argument("--preset", default="lightkv-budget", choices=sorted(PRESETS),
                   help="pipeline to compare with the uncompressed model (default: lightkv-budget)")
    p.add_argument("--questions", type=int, default=8, help="held-out questions to ask (default 8)")
    p.add_argument("--seed", type=int, default=7, help="which held-out episodes (default 7)")
    p.add_argument("--contrast", type=int, default=64, metavar="N",
                   help="held-out questions searched for one where lightkv and tome/random differ (0: skip)")
    p.add_argument("--out", default=".", help="directory for lightkv-demo-provenance.png (default: .)")
    p.add_argument("--no-png", action="store_true", help="do not write the provenance picture")
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
    from ..adapters import apply
    from ..bench.quality_report import provenance_picture
    from ..presets import get_preset
    from . import evaluate
    from . import model as dg

    args = build_parser().parse_args(argv)
    if args.questions < 1 or args.contrast < 0:
        print("lightkv demo: --questions must be >= 1 and --contrast >= 0", file=sys.stderr)
        return 2
    out = Path(args.out)
    if not args.no_png and out.exists() and not out.is_dir():
        print(f"lightkv demo: --out {out} is a file; give a directory for lightkv-demo-provenance.png",
              file=sys.stderr)
        return 2
    path = dg.resolve_model(args.model)
    try:
        model, _, grid = dg.load(path)
        data = dg.read_task(path).data
    except (FileNotFoundError, OSError, ValueError) as e:
        print(f"lightkv demo: cannot load the model from {path}: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    pipe = get_preset(args.preset)
    num_layers = model.config.text_config.num_hidden_layers
    try:
        session = apply(pipe, model)
    except ValueError as e:
        print(f"lightkv demo: preset {args.preset!r} does not fit this {num_layers}-layer model: {e}",
              file=sys.stderr)
        return 2
    episodes = evaluate.heldout_episodes(args.questions, seed=args.seed, grid=grid)
    n_img = data.num_image_tokens(grid, model.config.vision_config.patch_size)
    print(f"model: {path} ({num_layers} decoder layers, {n_img} vision tokens per image, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")
    print(f"pipeline: {args.preset} ({pipe.scheduler.__class__.__name__}); held-out episodes, seed {args.seed}\n")
    w = 18 if data.__name__.endswith("digitgrid.data") else 26
    head = (f"{'question':28s} {'truth':{w}s} {'uncompressed':{w}s} {args.preset:{w}s} "
            f"{'kept':>5s} {'vision KV':>17s} {'prefill ms':>13s}")
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
        print(f"{' '.join(ep.question):28s} {_short(ep.answer, w)} "
              f"{_short(base, w, mark[0])} {_short(got, w, mark[1])} "
              f"{rep.kept_vision_fraction:5.2f} {kv:>17s} {t_base:6.1f}/{t_comp:<6.1f}")
    n = len(episodes)
    print(f"\ncorrect: {right[0]}/{n} uncompressed, {right[1]}/{n} with {args.preset} "
          "(vision KV: compressed/uncompressed, summed over layers; prefill: uncompressed/compressed, median of 3; "
          "on a model this small the hooks cost more than the layers they shorten)")
    if args.contrast:
        _contrast(model, grid, num_layers, args)
    if not args.no_png:
        out.mkdir(parents=True, exist_ok=True)
        target = out / "lightkv-demo-provenance.png"
        drawn = provenance_picture(target, str(path))
        print(f"wrote {target}: '{drawn['question']}' (answer {drawn['answer']}): the image, lightkv's prompt "
              f"relevance ({drawn['relevance_share_asked']:.0%} on the asked cell, which is 1/{grid.grid ** 2} of the "
              "image), and which patches merged into which token with lightkv and with prompt-agnostic ToMe")
    return 0


def _short(words: list[str], width: int, mark: str | None = None) -> str:
    text = " ".join(words) + ("" if mark is None else f" {mark}")
    return (text if len(text) <= width else text[: width - 3] + "...").ljust(width)


CONTRAST_METHODS = ("tome", "random")


def _contrast(model, grid, num_layers: int, args) -> None:
    """The first of ``args.contrast`` held-out questions (seed ``args.seed + 1``) that lightkv
    answers right and tome or random gets wrong, at 55% kept each (their schedules as the
    quality benchmark builds them)."""
    from ..adapters import apply
    from ..bench.quality import method_pipeline
    from . import evaluate, scoring

    convs = scoring.conversations(args.contrast, grid, seed=args.seed + 1, followup=False)
    scores = {m: scoring.score(model, convs, grid, method_pipeline(m, num_layers, 0.55)[0], batch=32)
              for m in ("lightkv", *CONTRAST_METHODS)}
    rule = (f"rule: the first of {args.contrast} held-out questions (seed {args.seed + 1}) that lightkv answers "
            f"right and {' or '.join(CONTRAST_METHODS)} wrong, every method at 55% kept")
    hits = [i for i in range(len(convs)) if scores["lightkv"].correct[i]
            and any(not scores[m].correct[i] for m in CONTRAST_METHODS)]
    right = {m: int(s.correct.sum()) for m, s in scores.items()}
    print(f"\nwhere prompt-aware merging matters ({rule}); right out of {len(convs)}: "
          + ", ".join(f"{m} {n}" for m, n in right.items()))
    if not hits:
        print("  none found: on these questions every method answers as lightkv does")
        return
    ep = convs[hits[0]].first
    print(f"  question #{hits[0]}: '{' '.join(ep.question)}' -> {' '.join(ep.answer)}")
    for m in ("lightkv", *CONTRAST_METHODS):
        pipe, _ = method_pipeline(m, num_layers, 0.55)
        with apply(pipe, model) as session:
            got = evaluate.answer(model, [ep], grid)[0]
        ok = "ok" if got == ep.answer else "WRONG"
        print(f"  {m:8s} ({session.report().kept_vision_fraction:.0%} kept): {' '.join(got)} {ok}")


if __name__ == "__main__":
    sys.exit(main())
