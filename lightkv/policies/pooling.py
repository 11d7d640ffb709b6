"""Partitioners with one fixed destination per block: spatial pooling and tomesd's split.

* `AnchorPartitioner` (``anchor``): the schedule's 2-D windows, and the first token of each
  window (its top-left survivor) is the window's only destination. With
  ``window_size=(k, k)`` and a ratio of at least ``1 - 1/k**2`` every window collapses into
  its anchor, which with a size-weighted mean is ``k x k`` average pooling (partial windows
  at the right and bottom edges are pooled too, like ``ceil_mode=True``).
* `StridedPartitioner` (``strided``): one window per image (or batch row); the top-left
  token of every full ``stride`` block of the grid is a destination and every other token
  a source. This is the split of ``tomesd.merge.bipartite_soft_matching_random2d`` with
  ``no_rand=True`` and ``(sy, sx) = stride``.

Both split by grid coordinates, which survivors keep, and destinations are never removed,
so the same tokens stay destinations at later stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..graph.scatter import segment_rank
from ..graph.windows import grid_windows
from .partitioners import GlobalPartitioner, Partition, Partitioner

__all__ = ["AnchorPartitioner", "StridedPartitioner"]


@Partitioner.register("anchor")
@dataclass
class AnchorPartitioner(Partitioner):
    """The schedule's 2-D windows with a single destination each: the window's first token.

    The first token in sequence order is the window's top-left survivor (raster order on
    the grid). Every other token of the window is a source, so one stage can merge a whole
    window into one token: with ``window_size: [[2, 2]]``, ratio ``0.75`` and the
    ``size_mean`` passer, a stage is 2x2 average pooling. Unlike the ``grid`` partitioner,
    a ``window_size`` larger than an image is fine: its windows are just partial.
    """

    def partition(self, inputs):
        window = grid_windows(inputs.layout, inputs.spec.windows_per_side, inputs.spec.window_size, partial=True)
        inside = window >= 0
        is_src = torch.zeros_like(inside)
        is_src[inside] = segment_rank(window[inside]) > 0
        return Partition(window, is_src)


@Partitioner.register("strided")
@dataclass
class StridedPartitioner(Partitioner):
    """One window per image (or per row); destinations on a stride lattice of the grid.

    A token at grid ``(row, col)`` of an ``h x w`` image is a destination when
    ``row % sy == 0 and col % sx == 0`` and it lies inside the full blocks
    (``row < (h // sy) * sy`` and ``col < (w // sx) * sx``); every other token is a
    source. This is tomesd's ``no_rand=True`` split (the top-left token of each
    ``sy x sx`` block; the margin that does not fill a block is all sources). The
    schedule's window settings are ignored.

    Attributes:
        stride: ``(sy, sx)``: block rows and columns (tomesd's defaults are ``(2, 2)``;
            ``(1, 2)`` makes every even column a destination).
        scope: ``image`` (one window per image, as tomesd) or ``row`` (one per batch row).
    """

    stride: tuple[int, int] = (2, 2)
    scope: Literal["image", "row"] = "image"

    def __post_init__(self) -> None:
        stride = tuple(self.stride)
        if len(stride) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in stride):
            raise ValueError(f"stride must be two positive integers (sy, sx), got {self.stride!r}")
        self.stride = stride  # type: ignore[assignment]

    def partition(self, inputs):
        layout = inputs.layout
        window = GlobalPartitioner(scope=self.scope, split="all_src").partition(inputs).window
        inside = window >= 0
        sy, sx = self.stride
        img = layout.image.clamp_min(0)
        h = layout.image_grid[:, 0][img] if layout.num_images else torch.zeros_like(img)
        w = layout.image_grid[:, 1][img] if layout.num_images else torch.zeros_like(img)
        r, c = layout.coords[..., 0], layout.coords[..., 1]
        is_dst = (
            (r % sy == 0)
            & (c % sx == 0)
            & (r < torch.div(h, sy, rounding_mode="floor") * sy)
            & (c < torch.div(w, sx, rounding_mode="floor") * sx)
        )
        return Partition(window, inside & ~is_dst)
