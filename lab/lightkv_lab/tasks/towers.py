"""The bundled models' vision towers are shallower than the ones the presets are written for:
`fit_tower` puts a preset's tower layers at the same relative depth."""

from __future__ import annotations

from dataclasses import fields, replace

__all__ = ["REF_TOWER_DEPTH", "fit_tower"]

REF_TOWER_DEPTH = 24
"""The vision tower the shipped presets' tower layers are written for (CLIP ViT-L/14: VScan's
local scan reads its layer 5)."""


def fit_tower(pipe, depth: int):
    """``pipe`` with every tower layer a policy reads (``tower_layers``: VScan's local scan)
    scaled from `REF_TOWER_DEPTH` to a tower of ``depth`` layers, ``min(depth - 1,
    round(layer * depth / 24))`` (Scenes' 3 layers: VScan's layer 5 becomes 1), as the
    benchmarks scale decoder layers from 32; a pipeline that names none is returned as is."""
    fitted = {}
    for part in ("partitioner", "scorer", "pruner", "passer"):
        policy = getattr(pipe, part)
        layers = set(getattr(policy, "tower_layers", ()))
        names = (
            [f.name for f in fields(policy) if getattr(policy, f.name) in layers] if layers else []
        )
        if names:
            new = {
                n: min(depth - 1, round(getattr(policy, n) * depth / REF_TOWER_DEPTH))
                for n in names
            }
            fitted[part] = replace(policy, **new)
    return replace(pipe, **fitted) if fitted else pipe
