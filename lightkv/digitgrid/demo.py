"""``lightkv demo``: the bundled DigitGrid LVLM answers held-out questions with and without LightKV.

Loads the model shipped in the package (`lightkv.digitgrid.model.BUNDLED_MODEL`, offline),
renders a few held-out images, asks one question of each type about them and answers
each twice: uncompressed, then with a pipeline (default ``lightkv-budget``: LightKV at 55%
of the vision KV cache, stages placed for this model's depth). Prints one row per question
(answer, correct?, kept vision fraction, vision KV bytes, prefill time) and writes a picture
of which tokens merged into which for a cell question.
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

    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].strip("`"))
    p.add_argument("--model", default=None, help="DigitGrid model directory (default: the bundled one)")
    p.add_argument("--preset", default="lightkv-budget", choices=sorted(PRESETS),
                   help="pipeline to compare with the uncompressed model (default: lightkv-budget)")
    p.add_argument("--questions", type=int, default=8, help="held-out questions to ask (default 8)")
    p.add_argument("--seed", type=int, default=7, help="which held-out episodes (default 7)")
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
    from ..bench.quality_report import provenance_picture
    from ..pipeline import Pipeline
    from . import data, evaluate
    from . import model as dg

    args = build_parser().parse_args(argv)
    if args.questions < 1:
        print("lightkv demo: --questions must be >= 1", file=sys.stderr)
        return 2
    path = Path(args.model) if args.model else dg.BUNDLED_MODEL
    try:
        model, _, grid = dg.load(path)
    except (FileNotFoundError, OSError) as e:
        print(f"lightkv demo: cannot load the DigitGrid model from {path}: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    pipe = Pipeline.from_preset(args.preset)
    num_layers = model.config.text_config.num_hidden_layers
    try:
        session = pipe.apply(model)
    except ValueError as e:
        print(f"lightkv demo: preset {args.preset!r} does not fit this {num_layers}-layer model: {e}",
              file=sys.stderr)
        return 2
    episodes = evaluate.heldout_episodes(args.questions, seed=args.seed, grid=grid)
    n_img = data.num_image_tokens(grid, model.config.vision_config.patch_size)
    print(f"model: {path} ({num_layers} decoder layers, {n_img} vision tokens per image, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")
    print(f"pipeline: {args.preset} ({pipe.scheduler.__class__.__name__}); held-out episodes, seed {args.seed}\n")
    head = (f"{'question':36s} {'truth':18s} {'uncompressed':18s} {args.preset:18s} "
            f"{'kept':>5s} {'vision KV':>17s} {'prefill ms':>13s}")
    print(head)
    print("-" * len(head))
    right = [0, 0]
    for ep in episodes:
        base = evaluate.answer(model, [ep], grid)[0]
        with session:
            got = evaluate.answer(model, [ep], grid)[0]
        rep = session.report()
        inputs = data.collate_prompts([ep], n_img)
        t_base, t_comp = _prefill_ms(model, inputs), _prefill_ms(model, inputs, session)
        ok = [base == ep.answer, got == ep.answer]
        right = [r + o for r, o in zip(right, ok)]
        mark = ["ok" if o else "WRONG" for o in ok]
        kv = f"{rep.kv_bytes_vision / 1024:.0f}/{rep.kv_bytes_vision_baseline / 1024:.0f} KiB"
        print(f"{' '.join(ep.question):36s} {' '.join(ep.answer):18s} "
              f"{(' '.join(base) + ' ' + mark[0]):18s} {(' '.join(got) + ' ' + mark[1]):18s} "
              f"{rep.kept_vision_fraction:5.2f} {kv:>17s} {t_base:6.1f}/{t_comp:<6.1f}")
    n = len(episodes)
    print(f"\ncorrect: {right[0]}/{n} uncompressed, {right[1]}/{n} with {args.preset} "
          "(vision KV: compressed/uncompressed, summed over layers; prefill: uncompressed/compressed, median of 3; "
          "on a model this small the hooks cost more than the layers they shorten)")
    if not args.no_png:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        target = out / "lightkv-demo-provenance.png"
        drawn = provenance_picture(target, str(path))
        print(f"wrote {target}: '{drawn['question']}' (answer {drawn['answer']}): the image, lightkv's prompt "
              f"relevance ({drawn['relevance_share_asked']:.0%} on the asked cell, which is 1/16 of the image), and "
              "which patches merged into which token with lightkv and with prompt-agnostic ToMe")
    return 0


if __name__ == "__main__":
    sys.exit(main())
