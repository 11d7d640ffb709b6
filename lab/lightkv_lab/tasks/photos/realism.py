"""Realism of the Photos instrument's vision side, beside Scenes'
(``python -m lightkv_lab.tasks.photos.realism --n 200 --out results.json``).

On ``n`` fresh held-out Photos images (features from the cache, `features.cached_features`):
the [CLS] row's concentration at the layer the projector reads and at the last layer
(`measure.cls_concentration`) and the near-duplicate share of the tokens the projector reads
(`measure.feature_near_duplicates`, 4 x 4 windows). The same two figures for the bundled
Scenes model's tower on ``n`` Scenes images, so the two instruments sit side by side, and
(``--plain N``) for the tower on ``N`` of the photograph crops with nothing drawn on them.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace

import torch

from lightkv.outputs import write_atomic
from lightkv_lab.tasks.photos.features import cached_features, image_set
from lightkv_lab.tasks.photos.measure import (
    cls_concentration,
    feature_near_duplicates,
    summarise,
)

__all__ = ["main", "photos_realism", "scenes_realism"]


def _concentration(rows: torch.Tensor) -> dict:
    c = cls_concentration(rows)
    return {
        "entropy": summarise(c["entropy"]),
        "top_mass": summarise(c["top_mass"]),
        "top_k": c["k"],
        "uniform_top_mass": c["k"] / rows.shape[-1],
    }


def photos_realism(n: int, cache_dir: str, seed: int = 0, plain: bool = False) -> dict:
    """The Photos figures on ``n`` held-out images of the set seeded ``seed`` (``plain``: the
    same photograph crops with nothing drawn on them, the tower on real photos alone)."""
    layouts = image_set("heldout", seed, n)
    if plain:
        layouts = [replace(lay, objects=(), dots=(), sign=None) for lay in layouts]
    got = cached_features(layouts, cache_dir)
    feats = got["features"].float()
    return {
        "images": n,
        "set": {"split": "heldout", "seed": seed, "plain": plain},
        "cls_projector_layer": _concentration(got["cls"][:, 0]),
        "cls_last_layer": _concentration(got["cls"][:, 1]),
        "near_duplicates": feature_near_duplicates(feats, 16),
    }


@torch.no_grad()
def scenes_realism(n: int, seed: int = 0) -> dict:
    """The same figures for the bundled Scenes model (its tower's [CLS] row at the layer
    the projector reads; the tokens it reads)."""
    from lightkv_lab.tasks.model import load
    from lightkv_lab.tasks.registry import get_task

    model, _, grid = load("scenes")
    task = get_task("scenes")
    _, images = task.image_batch(random.Random(f"realism:{seed}"), "heldout", n, grid)
    tower = model.model.vision_tower
    tower.set_attn_implementation("eager")
    out = tower(images, output_hidden_states=True, output_attentions=True)
    layer = model.config.vision_feature_layer
    index = len(out.attentions) + layer if layer < 0 else layer - 1
    row = out.attentions[index][:, :, 0, 1:].float().sum(1)
    feats = out.hidden_states[layer][:, 1:]
    return {
        "images": n,
        "feature_layer": layer,
        "cls_projector_layer": _concentration(row / row.sum(-1, keepdim=True)),
        "near_duplicates": feature_near_duplicates(feats, grid.grid),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m lightkv_lab.tasks.photos.realism")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plain", type=int, default=0, help="also the tower on this many undrawn photo crops"
    )
    p.add_argument("--cache", default="runs/photos-features")
    p.add_argument("--out", default=None, help="write the JSON here (atomically)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    result = {
        "photos": photos_realism(args.n, args.cache, args.seed),
        "scenes": scenes_realism(args.n, args.seed),
    }
    if args.plain:
        result["photographs_alone"] = photos_realism(args.plain, args.cache, args.seed, True)
    result["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        write_atomic(args.out, text)
    print(text)
    return result


if __name__ == "__main__":
    main()
