"""Partitioners with one fixed destination per block: spatial pooling and tomesd's split.

* `AnchorPartitioner` (``anchor``): the schedule's 2-D windows, and the first token of each
  window (its top-left survivor) is the window's only destination. With
  ``window_size=(k, k)`` and a ratio of at least ``1 - 1/k**2`` every window collapses into
  its anchor, which with a size-weighted mean is ``k x k`` average pooling (partial windows
  at the right and bottom edges are pooled too, like ``ceil_mode=True``).
* `ResizePartitioner` (``resize``): each image's grid cut into an ``h' x w'`` grid of
  blocks with ``h' w'`` at most the kept count the stage's ratio asks for; with the
  ``all_sources`` pruner and the ``size_mean`` passer a stage is the downsampling baseline
  (average pooling of the token grid to a target count).
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
from ..policies.counts import image_vision_counts, kept_count
from ..policies.partitioners import GlobalPartitioner, Partition, Partitioner

__all__ = ["AnchorPartitioner", "ResizePartitioner", "StridedPartitioner", "resized_grid"]


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

    def max_removal_ratio(self, spec) -> float:
        """All but the anchor of a ``rows x cols`` window: ``1 - 1 / (rows cols)`` (1.0 with
        ``windows_per_side``, whose windows' sizes depend on the image)."""
        if spec.window_size is None:
            return 1.0
        rows, cols = spec.window_size
        return 1.0 - 1.0 / (rows * cols)

    def partition(self, inputs):
        window = grid_windows(
            inputs.layout, inputs.spec.windows_per_side, inputs.spec.window_size, partial=True
        )
        inside = window >= 0
        is_src = torch.zeros_like(inside)
        is_src[inside] = segment_rank(window[inside]) > 0
        return Partition(window, is_src)


def resized_grid(
    h: torch.Tensor, w: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h', w')`` per image: the most cells ``h' w' <= k`` with ``h'`` one of the two
    integers around the aspect-preserving height ``x = h sqrt(k / (h w))`` (each in
    ``[1, h]``) and ``w' = min(w, floor(k / h'))`` (at least 1); at equal cell counts the
    ``h'`` nearest ``x``. ``[I]`` int64 each."""
    x = h.double() * torch.sqrt(k.double() / (h * w).clamp_min(1).double())
    hi = h.clamp_min(1)

    def cells(hh):
        hh = torch.minimum(hh.clamp(min=1), hi)
        ww = torch.minimum(torch.div(k, hh, rounding_mode="floor").clamp_min(1), w.clamp_min(1))
        return hh, ww

    (h0, w0), (h1, w1) = cells(torch.floor(x).long()), cells(torch.ceil(x).long())
    p0, p1 = h0 * w0, h1 * w1
    first = (p0 > p1) | ((p0 == p1) & ((x - h0).abs() <= (x - h1).abs()))
    return torch.where(first, h0, h1), torch.where(first, w0, w1)


@Partitioner.register("resize")
@dataclass
class ResizePartitioner(Partitioner):
    """Downsampling to a token count: each image's ``h x w`` grid is cut into ``h' x w'``
    blocks (token row ``r`` goes to block row ``floor(r h' / h)``, column ``c`` to block
    column ``floor(c w' / w)``); the first token of each block (its top-left) is the block's
    destination and every other token a source.

    ``(h', w')`` comes from the kept count ``k = n - floor(P n)`` of the stage's removal
    ratio ``P`` (`resized_grid`): the grid of the image's aspect ratio with at most ``k``
    cells, so downsampling keeps ``h' w' <= k`` tokens (64 of 576 is 8 x 8 exactly; 28 of
    256 is 5 x 5 = 25). Blocks are disjoint and cover the grid, so with ``all_sources`` and
    ``size_mean`` a stage averages each block: ``torch.nn.functional.adaptive_avg_pool2d``
    where ``h' | h`` and ``w' | w`` (the plain downsampling baseline that VTC-Bench, Liao
    et al. 2025, arXiv:2510.07143, finds competitive with many pruning methods). The
    schedule's window settings are ignored. Use it on a stage's original grid (a pre-LLM
    stage, or the first stage): survivors of earlier stages leave holes in the blocks.
    """

    def partition(self, inputs):
        layout = inputs.layout
        vision = layout.vision_mask
        if not bool(vision.any()):
            return Partition.empty(layout)
        window, is_src = Partition.empty(layout).window, torch.zeros_like(vision)
        n = image_vision_counts(layout)
        k = kept_count(n, inputs.spec.removal_ratio)
        h, w = layout.image_grid[:, 0], layout.image_grid[:, 1]
        hh, ww = resized_grid(h, w, k)
        img = layout.image[vision]
        r, c = layout.coords[..., 0][vision], layout.coords[..., 1][vision]
        block = torch.div(r * hh[img], h[img], rounding_mode="floor") * ww[img] + torch.div(
            c * ww[img], w[img], rounding_mode="floor"
        )
        span = int((hh * ww).max())
        touched = (k < n)[img]  # an image that keeps everything stays out of the graph
        key = img * span + block
        win = torch.full_like(img, -1)
        if bool(touched.any()):
            win[touched] = torch.unique(key[touched], sorted=True, return_inverse=True)[1]
        window[vision] = win
        src = torch.zeros_like(touched)
        src[touched] = segment_rank(win[touched]) > 0
        is_src[vision] = src
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
        if len(stride) != 2 or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in stride
        ):
            raise ValueError(f"stride must be two positive integers (sy, sx), got {self.stride!r}")
        self.stride = stride  # type: ignore[assignment]

    def max_removal_ratio(self, spec) -> float:
        """All but one token of each ``sy x sx`` block: ``1 - 1 / (sy sx)``."""
        return 1.0 - 1.0 / (self.stride[0] * self.stride[1])

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
