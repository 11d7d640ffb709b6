"""Realism measurements of an instrument's vision side, independent of the language model.

`cls_concentration` is how the tower's [CLS] attention row concentrates at a layer (what
VisionZip, VisPruner, HoloV and SCOPE read): its normalised entropy over the patches and the
mass of its top 11%. `feature_near_duplicates` is redundancy in what the projector reads: the
share of patches whose most similar other patch in the same window (``windows_per_side``
windows per side) has cosine >= ``threshold`` after subtracting the image's mean token, as
`lightkv_lab.tasks.scenes.measure.near_duplicates` computes it on decoder hidden states.
"""

from __future__ import annotations

import math

import torch

__all__ = ["cls_concentration", "cls_rows", "feature_near_duplicates", "summarise"]


def cls_rows(attentions: torch.Tensor) -> torch.Tensor:
    """``[B, N]``: the [CLS] query's attention over the patches (``attentions [B, H, 1 + N,
    1 + N]`` of one layer), summed over heads as VisionZip does, renormalised to sum 1."""
    row = attentions[:, :, 0, 1:].float().sum(1)
    return row / row.sum(-1, keepdim=True)


def cls_concentration(rows: torch.Tensor, top: float = 0.11) -> dict[str, torch.Tensor]:
    """Per image: ``entropy`` (normalised: 1 is uniform) and ``top_mass`` (the mass of the
    ``round(top * N)`` largest entries, 28 of 256 for 11%; uniform gives ``k / N``, 10.9%) of
    ``rows [B, N]`` (each a distribution)."""
    n = rows.shape[-1]
    p = rows.clamp_min(1e-30)
    entropy = -(p * p.log()).sum(-1) / math.log(n)
    k = max(1, round(top * n))
    return {"entropy": entropy, "top_mass": rows.topk(k, dim=-1).values.sum(-1), "k": k}


def summarise(values: torch.Tensor) -> dict[str, float]:
    """``{mean, min, p10, median, p90, max}`` of a 1-D tensor."""
    v = values.float()
    q = torch.quantile(v, torch.tensor([0.1, 0.5, 0.9]))
    return {
        "mean": float(v.mean()),
        "min": float(v.min()),
        "p10": float(q[0]),
        "median": float(q[1]),
        "p90": float(q[2]),
        "max": float(v.max()),
    }


def feature_near_duplicates(
    tokens: torch.Tensor, side: int, windows_per_side: int = 4, threshold: float = 0.9
) -> dict:
    """Redundancy of ``tokens [B, side * side, D]`` (raster order): ``share`` of tokens with
    another token of their window at cosine >= ``threshold`` (centred per image), ``shares``
    at 0.8 / 0.9 / 0.95, and ``mean_best``."""
    if side % windows_per_side:
        raise ValueError(f"windows_per_side ({windows_per_side}) must divide the side ({side})")
    w = side // windows_per_side
    cells = torch.arange(side)
    window = ((cells[:, None] // w) * windows_per_side + cells[None, :] // w).reshape(-1)
    same = window[:, None] == window[None, :]
    same.fill_diagonal_(False)
    x = tokens.float()
    unit = torch.nn.functional.normalize(x - x.mean(1, keepdim=True), dim=-1)
    best = (unit @ unit.transpose(1, 2)).masked_fill(~same, -2.0).amax(-1).flatten()
    return {
        "share": float((best >= threshold).float().mean()),
        "threshold": threshold,
        "shares": {str(t): float((best >= t).float().mean()) for t in (0.8, 0.9, 0.95)},
        "mean_best": float(best.mean()),
        "tokens": int(best.numel()),
    }
