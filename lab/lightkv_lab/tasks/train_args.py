"""The command line of `lightkv_lab.tasks.train` (its stages, sizes and recipe options)."""

from __future__ import annotations

import argparse

from lightkv_lab.tasks.digitgrid.vocab import GLYPHS
from lightkv_lab.tasks.registry import TASKS

__all__ = ["build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightkv_lab.tasks.train",
        description="Train a bundled LVLM on one of the tasks.",
    )
    p.add_argument(
        "stage",
        choices=("align", "qa", "tune", "export"),
        help="align: tower + projector; qa: decoder; tune: more decoder steps from qa.pt (fresh "
        "optimiser, --mix); export: --out/tune.pt or qa.pt to --export DIR",
    )
    p.add_argument("--out", default="runs/digitgrid", help="checkpoint directory (resumes from it)")
    p.add_argument("--export", default=None, help="write the Hugging Face model here after qa")
    p.add_argument(
        "--asked",
        nargs="+",
        default=None,
        metavar="QTYPE",
        help="export: the question types the exported model is evaluated on (symbolgrid)",
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument(
        "--until",
        type=int,
        default=None,
        help="stop after this step (checkpointed) without changing the --steps schedule",
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--questions", type=int, default=4, help="questions packed per image (qa)")
    p.add_argument(
        "--mix",
        nargs="+",
        default=None,
        metavar="QTYPE[=W]",
        help="qa/tune: question types to train on, with relative weights (default: all, uniform)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--decay", action="store_true", help="linear decay to 10%% of lr")
    p.add_argument("--task", default="digitgrid", choices=tuple(TASKS), help="which synthetic task")
    p.add_argument(
        "--cell-ce",
        action="store_true",
        help="align: also a cross-entropy on each token's cell word",
    )
    p.add_argument(
        "--translate",
        action="store_true",
        help="vision tokens carry M E[word] (M: seeded orthogonal) instead of E[word] (align and "
        "qa)",
    )
    p.add_argument(
        "--lookup-heads",
        type=int,
        default=0,
        help="with --mimetic --translate: heads per layer that start as text-to-vision lookups "
        "(qa)",
    )
    p.add_argument(
        "--freeze-lookup",
        action="store_true",
        help="with --lookup-heads: keep those heads' query and key projections fixed (qa)",
    )
    p.add_argument(
        "--slow-layers",
        type=int,
        default=0,
        help="qa: the first N decoder layers learn at --slow-lr x lr",
    )
    p.add_argument("--slow-lr", type=float, default=0.05)
    p.add_argument("--lookup-from", type=int, default=0, help="first layer with lookup heads (qa)")
    p.add_argument(
        "--lookup-qk", type=float, default=3.0, help="query scale of the lookup heads (qa)"
    )
    p.add_argument(
        "--circuit",
        action="store_true",
        help="symbolgrid: row + column cell embeddings and retrieval heads at init (needs "
        "--translate)",
    )
    p.add_argument(
        "--circuit-layer", type=int, default=3, help="decoder layer of the --circuit heads"
    )
    p.add_argument(
        "--head-dim", type=int, default=None, help="decoder head size (default width / heads)"
    )
    p.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base of the decoder")
    p.add_argument("--mimetic", action="store_true", help="near-identity query/key init (qa)")
    p.add_argument(
        "--mimetic-from",
        type=int,
        default=0,
        help="with --mimetic: layers before this one start as no-ops instead (qa)",
    )
    p.add_argument("--glyphs", default="handwritten", choices=GLYPHS)
    p.add_argument("--jitter", type=int, default=0)
    p.add_argument("--text-width", type=int, default=128)
    p.add_argument("--text-layers", type=int, default=6)
    p.add_argument(
        "--text-ffn", type=int, default=None, help="decoder MLP width (default 4 x width)"
    )
    p.add_argument("--vision-width", type=int, default=96)
    p.add_argument("--vision-layers", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-n", type=int, default=64)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument(
        "--images", type=int, default=3000, help="photos: training images (features cached)"
    )
    p.add_argument(
        "--cache", default="runs/photos-features", help="photos: the tower features' cache"
    )
    p.add_argument(
        "--aux", type=float, default=0.0, help="photos: weight of the per-patch naming loss"
    )
    p.add_argument(
        "--init-from",
        default=None,
        help="photos: start the decoder and projector from this qa.pt (fresh optimiser)",
    )
    p.add_argument(
        "--recency-layers",
        type=int,
        default=0,
        help="photos: decoder layers given a fixed recency prior (tasks.photos.recency)",
    )
    p.add_argument(
        "--recency-strength",
        type=float,
        default=0.0,
        help="photos: the prior's logit at distance 0 over distance 270",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p
