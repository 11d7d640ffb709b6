"""Pictures of what a pipeline did to an image: which original patches each token stands for.

A *provenance map* (``owner``) gives, for every original patch in raster order, the index of
the token it was merged into (``-1``: dropped), as `lightkv.graph.Provenance.owner` holds it
for the vision part of a sequence. From it:

* `group_mean`: every patch gets the mean of a per-patch quantity (its colour) over its group;
* `group_edges`: where neighbouring patches belong to different groups;
* raster pictures (``uint8`` tensors ``[H, W, 3]``, no plotting library): `paint_patches`
  scales per-patch colours up to pixels, `outline_groups` darkens the group borders and
  `merged_view` does all three (the "merged image");
* matplotlib panels: `pyplot` (headless), `show`, `heatmap` (e.g. prompt relevance),
  `draw_group_borders`, `outline_box` and `save_figure`.

```python
import torch
from lightkv_lab.vis import merged_view
owner = torch.tensor([0, 0, 2, 2, 0, 0, 2, 2, 8, 8, 8, 8, 8, 8, 8, 8])  # 4x4 patches, 3 groups
colours = torch.rand(16, 3)
picture = merged_view(owner, colours, grid=(4, 4), cell=10)  # [40, 40, 3] uint8
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightkv.outputs import write_atomic

__all__ = [
    "draw_group_borders",
    "group_edges",
    "group_mean",
    "heatmap",
    "merged_view",
    "outline_box",
    "outline_groups",
    "paint_patches",
    "pyplot",
    "save_figure",
    "show",
]


# ---------------------------------------------------------------------------- groups
def group_mean(owner: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[P, C]``: each patch's row of ``values`` replaced by the mean over the patches with
    the same ``owner``; patches with ``owner < 0`` (dropped) get zeros."""
    valid = owner >= 0
    idx = owner.clamp_min(0)
    n = int(idx.max()) + 1 if valid.any() else 1
    total = torch.zeros(n, values.shape[1], dtype=values.dtype).index_add_(
        0, idx[valid], values[valid]
    )
    count = torch.zeros(n, dtype=values.dtype).index_add_(
        0, idx[valid], torch.ones(int(valid.sum()), dtype=values.dtype)
    )
    mean = total / count.clamp_min(1).unsqueeze(1)
    return torch.where(
        valid.unsqueeze(1), mean[idx], torch.zeros(1, values.shape[1], dtype=values.dtype)
    )


def group_edges(owner: torch.Tensor, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(below, right)``: ``below[r, c]`` (shape ``[h - 1, w]``) is True where patch ``(r, c)``
    and the one below it belong to different groups, ``right[r, c]`` (``[h, w - 1]``) where
    it and its right neighbour do."""
    g = owner.reshape(grid)
    return g[1:, :] != g[:-1, :], g[:, 1:] != g[:, :-1]


# ---------------------------------------------------------------------------- raster pictures
def paint_patches(colours: torch.Tensor, grid: tuple[int, int], cell: int) -> torch.Tensor:
    """``[P, 3]`` per-patch colours in ``[0, 1]`` -> ``[h * cell, w * cell, 3]`` uint8."""
    h, w = grid
    img = (colours.clamp(0, 1).reshape(h, w, 3) * 255).round().to(torch.uint8)
    return img.repeat_interleave(cell, dim=0).repeat_interleave(cell, dim=1)


def outline_groups(
    img: torch.Tensor, owner: torch.Tensor, grid: tuple[int, int], cell: int, darken: int = 3
) -> torch.Tensor:
    """A copy of ``img`` (``paint_patches`` output) with the borders between provenance groups
    drawn two pixels wide at ``1 / darken`` of their brightness."""
    below, right = group_edges(owner, grid)
    border = torch.zeros(img.shape[:2], dtype=torch.bool)
    for r, c in below.nonzero().tolist():
        border[(r + 1) * cell - 1 : (r + 1) * cell + 1, c * cell : (c + 1) * cell] = True
    for r, c in right.nonzero().tolist():
        border[r * cell : (r + 1) * cell, (c + 1) * cell - 1 : (c + 1) * cell + 1] = True
    return torch.where(border.unsqueeze(-1), img // darken, img)


def merged_view(
    owner: torch.Tensor, colours: torch.Tensor, grid: tuple[int, int], cell: int
) -> torch.Tensor:
    """The "merged image": every patch painted with the mean colour of its provenance group
    (``colours``: ``[P, 3]`` in ``[0, 1]``), group borders darkened;
    ``uint8 [h*cell, w*cell, 3]``."""
    return outline_groups(paint_patches(group_mean(owner, colours), grid, cell), owner, grid, cell)


# ---------------------------------------------------------------------------- matplotlib panels
def pyplot():
    """``matplotlib.pyplot`` on the headless Agg backend (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def show(ax: Any, image: torch.Tensor) -> None:
    """An ``[H, W, 3]`` image (floats in ``[0, 1]`` or uint8), one square per pixel."""
    ax.imshow(image.numpy(), interpolation="nearest")


def heatmap(ax: Any, values: torch.Tensor, cmap: str = "magma") -> None:
    """A ``[h, w]`` map (e.g. prompt relevance per patch) as a colour-mapped image."""
    ax.imshow(values.float().numpy(), cmap=cmap, interpolation="nearest")


def draw_group_borders(
    ax: Any, owner: torch.Tensor, grid: tuple[int, int], color: str = "white", lw: float = 0.4
) -> None:
    """Lines between patches of different provenance groups, over an image drawn with one
    pixel per patch (`show`)."""
    from matplotlib.collections import LineCollection

    below, right = group_edges(owner, grid)
    segments = [[(c - 0.5, r + 0.5), (c + 0.5, r + 0.5)] for r, c in below.nonzero().tolist()]
    segments += [[(c + 0.5, r - 0.5), (c + 0.5, r + 0.5)] for r, c in right.nonzero().tolist()]
    if segments:
        ax.add_collection(
            LineCollection(segments, colors=color, linewidths=lw, capstyle="projecting")
        )


def outline_box(
    ax: Any,
    x: float,
    y: float,
    size: float,
    color: str = "red",
    lw: float = 2.5,
    height: float | None = None,
) -> None:
    """A rectangle outline whose top-left pixel is ``(x, y)`` (column, row), ``size`` pixels
    wide and ``height`` (default ``size``) high."""
    from matplotlib.patches import Rectangle

    ax.add_patch(
        Rectangle(
            (x - 0.5, y - 0.5),
            size,
            size if height is None else height,
            fill=False,
            lw=lw,
            ec=color,
        )
    )


def save_figure(fig: Any, path: Path | str, dpi: int = 110, ticks: bool = True) -> Path:
    """Lay out, save (PNG by the suffix) and close a figure; ``ticks=False`` hides every axis'
    ticks first (picture panels)."""
    if not ticks:
        for ax in fig.axes:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.tight_layout()
    try:  # rendered into a temporary file, renamed into place: a failed write keeps the old picture
        write_atomic(
            path, lambda f: fig.savefig(f, dpi=dpi, format=Path(path).suffix.lstrip(".") or "png")
        )
    finally:
        pyplot().close(fig)
    return Path(path)
