"""VScan's first stage as a partition: a local scan (the most attended tokens of every tile)
and a global scan (the most attended of the rest) are kept, every other token is merged into
the kept token it is most similar to.

Zhang, Ma, Fang, Yu, Zhang, Zhang, Xie, Sycara, Mi, Yu, "VScan: Rethinking Visual Token
Reduction for Efficient Large Vision-Language Models", TMLR 2026 (arXiv:2505.22654); code
github.com/Tencent/SelfEvolvingAgent (``VScan/llava/model/llava_arch.py`` at a82450e).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..graph.scatter import scatter_sum, segment_rank
from ..graph.windows import grid_windows
from ..policies.counts import image_vision_counts, kept_count
from ..policies.partitioners import Partition, Partitioner

__all__ = ["VScanScan"]


def _rank(value: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """``[M]`` rank of each entry inside its group: higher ``value`` first, ties to the
    earlier entry (``value`` float64, ``group`` int64, both in sequence order)."""
    by_value = torch.sort(-value, stable=True).indices
    order = by_value[torch.sort(group[by_value], stable=True).indices]
    rank = torch.empty_like(group)
    rank[order] = segment_rank(group[order])
    return rank


@Partitioner.register("vscan_scan")
@dataclass
class VScanScan(Partitioner):
    """VScan's global and local scans: kept tokens are side B, the others side A, one window
    per image; with the ``cosine`` scorer, the ``all_sources`` pruner and the ``size_mean``
    passer each dropped token is averaged into its most similar kept token.

    The rule (paper, Sec. 3, "global and local scans with token merging" of the visual
    encoding stage; the authors' ``encode_images``, ``window_cls_selection`` and
    ``token_merging``, ``VScan/llava/model/llava_arch.py`` lines 142-293 of
    github.com/Tencent/SelfEvolvingAgent at a82450e), per image of ``n`` tokens keeping
    ``k = n - floor(P n)`` (`kept_count`):

    * local scan: ``floor(local * k)`` tokens (``int(visual_token_num * local_ratio)``,
      ``local_ratio = 0.5``, lines 270-274) shared evenly over the image's tiles (6 x 6
      tokens on a 24 x 24 grid: ``tiles = 4`` per side), ``floor(floor(local k) / tiles)``
      each (line 225), the most attended tokens of each tile (``topk``, line 237);
    * global scan: the ``k - floor(local k)`` most attended of the other tokens (lines
      276-279: the local picks' attention is zeroed, then ``topk``);
    * every other token is averaged into its most similar kept token by cosine of the
      projected features (``token_merging``, lines 142-197, ``scaling = 1``: the mean of
      the kept token and the tokens merged into it).

    The local scan's layer. The code's local scan reads a shallow tower layer's CLS attention
    (``image_attentions[5]``, line 267: layer 5 of CLIP ViT-L's 24), its global scan the layer
    the projector reads (``image_attentions[-2]``, line 268). So does this partitioner: the
    global scan reads the stage's relevance (the ``vscan`` preset: ``tower_attention`` with
    ``heads: mean``), the local scan ``StageInputs.tower[local_layer]`` averaged over heads
    (``local_layer = 5``; the adapter reads that layer because it is in `tower_layers`; a
    tower with fewer layers is refused in one line naming the layer). ``local_layer = None``
    reads the stage's relevance for both scans.

    The counts. The code's global scan keeps ``k - floor(local k)`` tokens (line 279), so
    where ``floor(local k)`` is not a multiple of the tile count its image keeps fewer than
    ``k`` (98 of 100 at 576 tokens; on small grids far fewer: 6 of 11 on an 8 x 8 grid, whose
    16 tiles get no local pick). That shortfall is not copied: the global scan fills the
    budget (``fill = True``, the default: ``k`` minus the local picks), so the kept tokens are
    the code's plus the next ones of its global scan; ``fill = False`` keeps the code's count.

    What is the same (recorded fixtures at 576 tokens: the code's kept tokens and merged
    outputs, exactly where its count is ``k``): the shares, the per-tile quota, the global top-k,
    the merge. What differs: tiles
    are `grid_windows`' bands on any grid (the code's 6 x 6 windows assert a 24 x 24 grid: on
    other grids it does not run); a tile smaller than its quota gives all its tokens; ties go to
    the earliest token; kept tokens keep their places in the sequence.

    Attributes:
        local: share of the kept tokens chosen by the local scan (the code's 0.5).
        tiles: tiles per image side for the local scan (the code's 24 / 6 = 4).
        local_layer: 0-based tower layer whose CLS attention the local scan reads (the code's
            5), or None: the stage's relevance.
        fill: the global scan fills the budget exactly (default) instead of keeping the
            code's ``k - floor(local k)``.
    """

    local: float = 0.5
    tiles: int = 4
    local_layer: int | None = 5
    fill: bool = True

    def __post_init__(self) -> None:
        if (
            isinstance(self.local, bool)
            or not isinstance(self.local, (int, float))
            or not 0.0 <= float(self.local) <= 1.0
        ):
            raise ValueError(f"local must be a share in [0, 1], got {self.local!r}")
        if isinstance(self.tiles, bool) or not isinstance(self.tiles, int) or self.tiles < 1:
            raise ValueError(f"tiles must be a positive integer, got {self.tiles!r}")
        layer = self.local_layer
        if layer is not None and (
            isinstance(layer, bool) or not isinstance(layer, int) or layer < 0
        ):
            raise ValueError(
                f"local_layer must be a tower layer (an integer >= 0) or null, got {layer!r}"
            )
        if not isinstance(self.fill, bool):
            raise ValueError(f"fill must be true or false, got {self.fill!r}")

    @property
    def tower_layers(self) -> tuple[int, ...]:
        return () if self.local_layer is None else (self.local_layer,)

    def partition(self, inputs):
        layout = inputs.layout
        vision = layout.vision_mask
        if not bool(vision.any()):
            return Partition.empty(layout)
        if inputs.relevance is None:
            raise ValueError(
                "the vscan_scan partitioner ranks tokens by relevance: give the stage a relevance "
                "(VScan: tower_attention)"
            )
        n = image_vision_counts(layout)
        k = kept_count(n, inputs.spec.removal_ratio)
        img = layout.image[vision]  # [M], sequence order
        xi = inputs.relevance[vision].to(torch.float64)
        tile = grid_windows(layout, self.tiles)[
            vision
        ]  # [M] compact tile ids, each inside one image
        t = int(tile.max()) + 1
        tile_img = torch.zeros(t, dtype=torch.long, device=img.device).scatter_(0, tile, img)
        tiles_per_img = scatter_sum(torch.ones_like(tile_img), tile_img, layout.num_images)
        quota = torch.div(
            torch.floor(k.double() * float(self.local)).long(),
            tiles_per_img.clamp_min(1),
            rounding_mode="floor",
        )  # [I]
        if self.local_layer is None:
            shallow = xi
        else:  # the shallow layer's attention, averaged over heads (the code's .mean(dim=2))
            shallow = inputs.tower[self.local_layer].to(torch.float64).mean(1)[vision]
        local = _rank(shallow, tile) < quota[img]
        n_local = scatter_sum(local.long(), img, layout.num_images)
        n_global = (k - n_local) if self.fill else k - torch.floor(k.double() * self.local).long()
        rest = _rank(
            xi.masked_fill(local, -math.inf), img
        )  # the non-local first: their rank among themselves
        kept = local | (~local & (rest < n_global[img]))
        busy = k[img] < n[img]  # images that lose tokens
        window = Partition.empty(layout).window
        is_src = torch.zeros_like(vision)
        window[vision] = torch.where(busy, img, torch.full_like(img, -1))
        is_src[vision] = busy & ~kept
        used = torch.unique(window[window >= 0], sorted=True, return_inverse=True)[1]  # compact ids
        window[window >= 0] = used
        return Partition(window, is_src)
