"""The frozen tower's outputs, computed once per image set and cached on disk.

An image set is ``n`` layouts drawn from a seeded stream (`image_set`). `cached_features`
renders and runs the tower over it in shards of `SHARD` images; each shard is one file named
by the SHA-256 of everything that determines its content: the tower's ONNX file, the feature
layer, the code of the modules that draw the images (`images`, `layout`; their syntax trees
without docstrings, so editing prose keeps the cache) and the shard's layouts. A shard is
written atomically (temp file + rename), so a killed run keeps every finished shard and a
rerun computes only the rest; a changed renderer or tower gets new names, never stale
features.

A shard holds ``features`` (float16 ``[n, 256, 384]``: the hidden state the projector reads,
[CLS] dropped) and ``cls`` (float32 ``[n, 2, 256]``: the [CLS] attention row over the patches,
summed over heads and renormalised, at the projector's layer and at the last layer).
"""

from __future__ import annotations

import ast
import hashlib
import random
from functools import cache
from pathlib import Path

import torch

from lightkv.outputs import write_atomic
from lightkv_lab.tasks.photos.layout import DEFAULT_CONFIG, Layout, make_layout, render_image

__all__ = ["SHARD", "cache_key", "cached_features", "code_digest", "image_set", "tower_outputs"]

SHARD = 64
"""Images per cache file."""


def image_set(split: str, seed: int, n: int) -> list[Layout]:
    """``n`` layouts of ``split`` from the stream seeded ``(seed, split)``."""
    rng = random.Random(f"photos-set:{seed}:{split}")
    return [make_layout(rng, split, DEFAULT_CONFIG) for _ in range(n)]


def code_digest(source: str) -> str:
    """SHA-256 of a module's code without its comments, docstrings and layout (its syntax
    tree without string statements): editing prose does not invalidate cached features."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [
                s
                for s in body
                if not (
                    isinstance(s, ast.Expr)
                    and isinstance(s.value, ast.Constant)
                    and isinstance(s.value.value, str)
                )
            ]
            node.body = kept or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


@cache
def _source_digest() -> str:
    """SHA-256 of the ONNX file and of the code of the modules that draw the images."""
    from lightkv_lab.tasks.photos import images, layout
    from lightkv_lab.tasks.photos.tower import onnx_path

    h = hashlib.sha256()
    with open(onnx_path(), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    for module in (images, layout):
        h.update(code_digest(Path(module.__file__).read_text()).encode())
    return h.hexdigest()


def cache_key(layouts: list[Layout], layer: int, tower_id: str | None = None) -> str:
    """The name of the shard holding ``layouts``' features at tower hidden state ``layer``
    (``tower_id``: what names a tower other than the package's)."""
    h = hashlib.sha256((tower_id or _source_digest()).encode())
    h.update(f"layer={layer}".encode())
    for lay in layouts:
        h.update(repr(lay).encode())
    return h.hexdigest()[:32]


@torch.no_grad()
def tower_outputs(tower, pixel_values: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """``features [B, N, D]`` at hidden state ``layer`` ([CLS] dropped) and ``cls [B, 2, N]``
    (the [CLS] rows at the layer that produces that state and at the last layer) of one batch
    (``pixel_values`` normalised); ``tower`` runs with eager attention to return its maps."""
    out = tower(pixel_values, output_hidden_states=True, output_attentions=True)
    n_layers = len(out.attentions)
    index = n_layers + layer if layer < 0 else layer - 1
    rows = []
    for att in (out.attentions[index], out.attentions[-1]):
        row = att[:, :, 0, 1:].float().sum(1)
        rows.append(row / row.sum(-1, keepdim=True))
    return {"features": out.hidden_states[layer][:, 1:], "cls": torch.stack(rows, 1)}


def cached_features(
    layouts: list[Layout],
    cache_dir: str | Path,
    *,
    layer: int = -2,
    tower=None,
    tower_id: str | None = None,
    batch: int = 16,
    progress=None,
) -> dict[str, torch.Tensor]:
    """``{"features": float16 [n, 256, 384], "cls": float32 [n, 2, 256]}`` of ``layouts``,
    read from ``cache_dir`` where a shard exists, else computed and written there.

    ``tower`` is the package's ``Dinov2Model`` (built on first need) unless given; another
    tower needs a ``tower_id`` of its own (it replaces the ONNX file's digest in the key)."""
    from lightkv_lab.tasks.photos.data import normalise

    if tower is not None and tower_id is None:
        raise ValueError("cached_features: a tower passed in needs a tower_id naming it")

    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    parts: dict[str, list[torch.Tensor]] = {"features": [], "cls": []}
    for start in range(0, len(layouts), SHARD):
        chunk = layouts[start : start + SHARD]
        path = cache_dir / f"{cache_key(chunk, layer, tower_id)}.pt"
        if path.exists():
            shard = torch.load(path, weights_only=True)
        else:
            if tower is None:
                tower = _tower()
            outs: dict[str, list[torch.Tensor]] = {"features": [], "cls": []}
            for i in range(0, len(chunk), batch):
                images = torch.stack([render_image(lay) for lay in chunk[i : i + batch]])
                got = tower_outputs(tower, normalise(images), layer)
                outs["features"].append(got["features"].to(torch.float16))
                outs["cls"].append(got["cls"])
            shard = {k: torch.cat(v) for k, v in outs.items()}
            write_atomic(path, lambda f, shard=shard: torch.save(shard, f))
        for k in parts:
            parts[k].append(shard[k])
        if progress is not None:
            progress(min(start + SHARD, len(layouts)), len(layouts))
    return {k: torch.cat(v) for k, v in parts.items()}


def _tower():
    from transformers import Dinov2Model

    from lightkv_lab.tasks.photos.tower import load_tower, tower_config

    tower = Dinov2Model(tower_config(attn_implementation="eager")).eval()
    load_tower(tower)
    return tower
