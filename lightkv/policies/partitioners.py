"""Partitioners: cut the vision tokens into windows and split each window into A and B.

A is the source side (candidates for removal), B the destination side. Window-local
order is sequence order among the window's current tokens (raster order on the grid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..graph.layout import VisionLayout
from ..graph.scatter import scatter_sum, segment_rank
from ..graph.windows import Bands, check_bands, grid_windows, pseudo_square_windows
from .base import Policy
from .counts import image_vision_counts, kept_count
from .hashing import seeded_uniform, token_identity
from .inputs import StageInputs

__all__ = [
    "Partition",
    "Partitioner",
    "GridPartitioner",
    "PseudoSquarePartitioner",
    "GlobalPartitioner",
    "RelevanceSplit",
    "Split",
]

Split = Literal["parity", "checkerboard", "random", "all_src"]


@dataclass(frozen=True)
class Partition:
    """Windows and sides of one stage.

    Attributes:
        window: ``[B, N]`` int64 window id (compact, batch-wide), ``-1`` outside the graph.
        is_src: ``[B, N]`` bool, True for side A.
    """

    window: torch.Tensor
    is_src: torch.Tensor

    @classmethod
    def empty(cls, layout: VisionLayout) -> Partition:
        """No token in the graph (a stage with nothing to do, e.g. a text-only batch)."""
        return cls(torch.full_like(layout.image, -1), torch.zeros_like(layout.vision_mask))


class Partitioner(Policy):
    """Family: decides the windows and the A/B split of a stage."""

    family: ClassVar[str] = "partitioner"

    def max_removal_ratio(self, spec) -> float:
        """The largest share of a window's tokens one stage with spec ``spec`` (a
        `lightkv.policies.StageSpec`) can remove, whatever its removal ratio: only sources
        (side A) leave. The kept-fraction knob fits ratios within it. Default: a
        ``split`` other than ``all_src`` sends about half of each window to A (0.5),
        anything else states no limit (1.0)."""
        return 0.5 if getattr(self, "split", "all_src") != "all_src" else 1.0

    def partition(self, inputs: StageInputs) -> Partition:
        """Assign windows and sides.

        Args:
            inputs: the stage's inputs: ``inputs.layout`` (``[B, N]`` tokens),
                ``inputs.spec.windows_per_side`` / ``inputs.spec.window_size`` from the
                schedule, and the features and relevance for content-driven splits.

        Returns:
            a `Partition` with ``[B, N]`` tensors; window ids compact (``0 .. K-1``),
            ``-1`` for tokens outside the graph (never text, padding or structural tokens).
        """
        raise NotImplementedError

    @staticmethod
    def _skip_small(
        layout: VisionLayout,
        window: torch.Tensor,
        windows_per_side: int | None,
        min_tokens: int,
        by_video: bool = False,
    ) -> torch.Tensor:
        """Take every vision token of a row out of the graph when one of the row's images
        (with ``by_video``: a video counts as one image) has fewer than
        ``min_tokens * windows_per_side**2`` current vision tokens (the reference code's skip
        rule; it runs one row at a time, so the rule is per row here too)."""
        if not min_tokens or windows_per_side is None or not layout.num_images:
            return window
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
            raise ValueError(
                f"min_tokens_per_window must be a non-negative integer, got {min_tokens!r}"
            )
        vision = layout.vision_mask
        group, groups, group_row = layout.image, layout.num_images, layout.image_row
        if by_video and layout.num_videos:
            group = torch.where(layout.video >= 0, layout.num_images + layout.video, layout.image)
            groups = layout.num_images + layout.num_videos
            video_row = torch.zeros(layout.num_videos, dtype=torch.long, device=window.device)
            in_video = layout.image_video >= 0
            video_row[layout.image_video[in_video]] = layout.image_row[in_video]
            group_row = torch.cat([layout.image_row, video_row])
        count = scatter_sum(vision.long()[vision], group[vision], groups)
        small = count < min_tokens * windows_per_side**2
        # images without any current vision token (e.g. all merged away, or frames counted
        # in their video) do not count
        small &= count > 0
        if not bool(small.any()):
            return window
        rows = torch.zeros(layout.batch_size, dtype=torch.bool, device=window.device)
        rows[group_row[small]] = True
        return window.masked_fill(rows.unsqueeze(1), -1)

    def _split(
        self, layout: VisionLayout, window: torch.Tensor, split: Split, src_parity: int, seed: int
    ) -> torch.Tensor:
        inside = window >= 0
        is_src = torch.zeros_like(inside)
        if split == "all_src":
            return inside.clone()
        if split == "checkerboard":
            r, c = layout.coords[..., 0], layout.coords[..., 1]
            return inside & ((r + c) % 2 == src_parity)
        if split == "random":
            return inside & (
                (seeded_uniform(token_identity(layout), seed) < 0.5) == bool(src_parity == 0)
            )
        if split != "parity":
            raise ValueError(
                f"unknown split {split!r}; choose one of parity, checkerboard, random, all_src"
            )
        rank = segment_rank(window[inside])
        is_src[inside] = rank % 2 == src_parity
        return is_src


@Partitioner.register("grid")
@dataclass
class GridPartitioner(Partitioner):
    """True 2-D windows on each image's grid (lightkv default), then an A/B split.

    Attributes:
        bands: how a side is cut into bands: ``proportional`` (lightkv: longer bands spread
            over the side) or ``leading`` (the reference code: longer bands first).
        min_tokens_per_window: if set, a row is left alone when one of its images has fewer
            than ``min_tokens_per_window * W**2`` vision tokens (the reference code uses 8);
            0 never skips.
        min_kept_per_window: the window layout as a function of the budget (`sides`): an
            image that would keep fewer than this many tokens per window is cut into fewer
            windows per side, one window at the least; 0 (default) keeps the schedule's
            ``windows_per_side`` at every budget.
        split: ``parity`` (A = even window-local index, as the LightKV reference code),
            ``checkerboard`` (A where ``row + col`` has parity ``src_parity``), ``random``
            (a fixed hash of each token's position and ``seed``) or ``all_src``.
        src_parity: which parity goes to side A.
        seed: for ``random``.
    """

    split: Split = "parity"
    src_parity: int = 0
    seed: int = 0
    bands: Bands = "proportional"
    min_tokens_per_window: int = 0
    min_kept_per_window: int = 0

    def __post_init__(self) -> None:
        check_bands(self.bands)
        k = self.min_kept_per_window
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(
                f"grid: min_kept_per_window must be a non-negative integer (0: off), got {k!r}"
            )

    def sides(self, layout: VisionLayout, windows_per_side: int, ratio: float) -> torch.Tensor:
        """``[I]`` int64 windows per side of each image at removal ratio ``ratio``.

        An image of ``n`` current vision tokens on an ``h x w`` grid keeps
        ``k = n - floor(ratio * n)`` (`lightkv.policies.counts.kept_count`); cut into ``v``
        windows per side it has ``m(v) = min(v, h) * min(v, w)`` windows. It gets the largest
        ``v <= windows_per_side`` with ``k >= min_kept_per_window * m(v)``, and 1 where no
        ``v`` qualifies: a window never holds fewer than ``min_kept_per_window`` kept tokens
        on average unless the image is one window. With 2 x 2 windows and ``K = 8`` a 16 x 16
        image keeps 4 windows down to 32 kept tokens (12.5%) and one window below.
        """
        grid = layout.image_grid
        h, w = grid[:, 0], grid[:, 1]
        k = kept_count(image_vision_counts(layout), float(ratio))
        out = torch.ones_like(h)
        top = min(windows_per_side, int(grid.max()) if layout.num_images else 1)
        for v in range(2, top + 1):  # m(v) grows with v: the last v that fits wins
            fits = k >= self.min_kept_per_window * h.clamp(max=v) * w.clamp(max=v)
            out = torch.where(fits, torch.full_like(out, v), out)
        return out

    def partition(self, inputs):
        layout, windows_per_side = inputs.layout, inputs.spec.windows_per_side
        sides = None
        if self.min_kept_per_window and layout.num_images:
            if windows_per_side is None:
                raise ValueError(
                    "grid: min_kept_per_window needs the schedule's windows_per_side (it "
                    "chooses fewer windows per side), not window_size"
                )
            sides = self.sides(layout, windows_per_side, float(inputs.spec.removal_ratio))
        window = grid_windows(
            layout, windows_per_side, inputs.spec.window_size, bands=self.bands, sides=sides
        )
        window = self._skip_small(layout, window, windows_per_side, self.min_tokens_per_window)
        return Partition(
            window, self._split(layout, window, self.split, self.src_parity, self.seed)
        )


@Partitioner.register("pseudo_square")
@dataclass
class PseudoSquarePartitioner(Partitioner):
    """The LightKV reference code's windows: survivors re-packed into a pseudo-square
    (see `lightkv.graph.pseudo_square_windows`), then a parity split.

    Reproduces the token counts of the authors' release of LightKV (Chen, Guo, Zimmermann,
    TMLR 2026, arXiv:2605.00789): 576 -> 288 -> 145 -> 73 on LLaVA-1.5.

    Attributes:
        bands: band rule on the pseudo-square's side; ``leading`` (default) is the reference
            code's (longer bands first), ``proportional`` lightkv's.
        min_tokens_per_window: skip a row at a stage when one of its images has fewer than
            ``min_tokens_per_window * W**2`` vision tokens (the reference code: 8; 0 never
            skips).
        scope: ``image`` (each image and video frame packed on its own) or ``video`` (the
            frames of a video packed together as one long image, as the reference code
            treats a video).
    """

    split: Split = "parity"
    src_parity: int = 0
    seed: int = 0
    bands: Bands = "leading"
    min_tokens_per_window: int = 0
    scope: Literal["image", "video"] = "image"

    def __post_init__(self) -> None:
        check_bands(self.bands)
        if self.scope not in ("image", "video"):
            raise ValueError(f"unknown scope {self.scope!r}; choose 'image' or 'video'")

    def partition(self, inputs):
        layout, windows_per_side = inputs.layout, inputs.spec.windows_per_side
        if inputs.spec.window_size is not None or windows_per_side is None:
            raise ValueError(
                "the pseudo_square partitioner needs windows_per_side (it has no window_size form)"
            )
        by_video = self.scope == "video"
        window = pseudo_square_windows(
            layout, windows_per_side, bands=self.bands, by_video=by_video
        )
        window = self._skip_small(
            layout, window, windows_per_side, self.min_tokens_per_window, by_video
        )
        return Partition(
            window, self._split(layout, window, self.split, self.src_parity, self.seed)
        )


@Partitioner.register("global")
@dataclass
class GlobalPartitioner(Partitioner):
    """One window per image (``scope="image"``) or per batch row (``scope="row"``).

    With ``split="parity", src_parity=1`` this is ToMe's alternating bipartite split (even
    tokens are destinations; Bolya et al., ICLR 2023, arXiv:2210.09461); with
    ``split="all_src"`` it serves pure pruning (FastV, random).
    The schedule's window settings are ignored.
    """

    scope: Literal["image", "row"] = "image"
    split: Split = "parity"
    src_parity: int = 0
    seed: int = 0

    def partition(self, inputs):
        layout = inputs.layout
        if self.scope not in ("image", "row"):
            raise ValueError(f"unknown scope {self.scope!r}; choose 'image' or 'row'")
        vision = layout.vision_mask
        if self.scope == "image":
            key = layout.image
        else:
            key = (
                torch.arange(layout.batch_size, device=layout.device)
                .unsqueeze(1)
                .expand_as(layout.image)
            )
        window = torch.full_like(layout.image, -1)
        if vision.any():
            _, inv = torch.unique(key[vision], sorted=True, return_inverse=True)
            window[vision] = inv
        return Partition(
            window, self._split(layout, window, self.split, self.src_parity, self.seed)
        )


@Partitioner.register("relevance_split")
@dataclass
class RelevanceSplit(Partitioner):
    """The schedule's grid windows, split by prompt relevance: in each window the least
    relevant tokens are the sources (A) and the most relevant the destinations (B), so the
    tokens the prompt cares most about are never merged away; they receive.

    Ties in ξ go as the ``grid`` partitioner's parity split would send them (its sources
    first), then in sequence order; so with uniform relevance (or none) and the default
    ``sources=0.5, src_parity=0`` this is exactly ``grid`` with ``split: parity``, and at any
    relevance it has as many sources per window (``ceil(n_w / 2)``), so the token counts of
    a stage do not change.

    Attributes:
        sources: how many tokens of a window of ``n_w`` are sources: a fraction ``s`` in
            ``[0, 1]`` gives ``ceil(s · n_w)``; ``"ratio"`` gives the stage's
            ``floor(P · n_w)`` (at most ``n_w - 1``), exactly the tokens the plain budget
            removes, so every source leaves and the survivors are each window's most
            relevant tokens.
        src_parity: the parity split used to break ties.
        bands: as `GridPartitioner`.
        min_tokens_per_window: as `GridPartitioner`.
    """

    sources: float | Literal["ratio"] = 0.5
    src_parity: int = 0
    bands: Bands = "proportional"
    min_tokens_per_window: int = 0

    def __post_init__(self) -> None:
        check_bands(self.bands)
        if isinstance(self.sources, str):
            if self.sources != "ratio":
                raise ValueError(
                    f"sources must be a fraction in [0, 1] or 'ratio', got {self.sources!r}"
                )
        elif (
            isinstance(self.sources, bool)
            or not isinstance(self.sources, (int, float))
            or not 0.0 <= self.sources <= 1.0
        ):
            raise ValueError(
                f"sources must be a fraction in [0, 1] or 'ratio', got {self.sources!r}"
            )

    def max_removal_ratio(self, spec) -> float:
        """``sources`` of each window can leave (``"ratio"``: as many as the ratio asks)."""
        return 1.0 if self.sources == "ratio" else float(self.sources)

    def source_count(self, n: torch.Tensor, ratio: float) -> torch.Tensor:
        """``[K]`` int64 sources per window from the window sizes ``n [K]``."""
        if self.sources == "ratio":
            return torch.minimum(torch.floor(n.double() * ratio).long(), n - 1).clamp_min(0)
        return torch.ceil(n.double() * float(self.sources) - 1e-9).long().clamp(min=0).minimum(n)

    def partition(self, inputs):
        """``[B, N]`` grid windows; per window the ``source_count`` least relevant tokens are A."""
        layout, windows_per_side = inputs.layout, inputs.spec.windows_per_side
        window = grid_windows(layout, windows_per_side, inputs.spec.window_size, bands=self.bands)
        window = self._skip_small(layout, window, windows_per_side, self.min_tokens_per_window)
        inside = window >= 0
        is_src = torch.zeros_like(inside)
        if not bool(inside.any()):
            return Partition(window, is_src)
        w = window[inside]  # [V], in sequence order
        if inputs.relevance is None:
            xi = torch.ones(w.shape, dtype=torch.float64, device=w.device)
        else:
            xi = inputs.relevance[inside].to(torch.float64)
        parity_src = segment_rank(w) % 2 == self.src_parity
        # order by (window, ξ ascending, the parity split's sources first, sequence order)
        order = torch.sort((~parity_src).to(torch.uint8), stable=True).indices
        order = order[torch.sort(xi[order], stable=True).indices]
        order = order[torch.sort(w[order], stable=True).indices]
        k = int(w.max()) + 1
        n = scatter_sum(torch.ones_like(w), w, k)
        start = torch.cumsum(n, 0) - n
        rank = torch.empty_like(w)
        rank[order] = torch.arange(w.numel(), device=w.device) - start[w[order]]
        is_src[inside] = rank < self.source_count(n, float(inputs.spec.removal_ratio))[w]
        return Partition(window, is_src)
