"""Assigning vision tokens to spatial windows.

Two geometries:

* `grid_windows`: true 2-D windows on each image's own grid. Survivors of earlier stages
  keep their original ``(row, col)``, so a window is always a real image region, for any
  grid shape and at every stage. lightkv's default.
* `pseudo_square_windows`: the reference code's arithmetic. The current vision tokens of
  an image are taken in sequence order and re-packed row-major into a pseudo-square of
  side ``ceil(sqrt(n))``; windows cut that square. It reproduces the paper's token counts
  (576 -> 288 -> 145 -> 73 for LLaVA-1.5 at 4/2/1 windows per side) but its windows are
  only approximately spatial after the first stage or on non-square grids.

Both cut a side of ``s`` rows (or columns) into ``W`` bands with one of two rules
(``bands``):

* ``"proportional"`` (lightkv's default): row ``r`` goes to band ``floor(r * W / s)``, which
  spreads the longer bands over the side (s = 32, W = 6: 6, 5, 5, 6, 5, 5);
* ``"leading"`` (the reference code's): ``W`` bands of ``floor(s / W)`` rows, the *first*
  ``s mod W`` of them one row longer (s = 32, W = 6: 6, 6, 5, 5, 5, 5).

Both give the same band lengths, only in another order, so token counts agree while the windows
themselves differ. Both return window ids that are unique across the whole batch (``-1`` for tokens
that are not vision tokens) and compact (``0 .. num_windows - 1``, in order of first appearance by
image, then by window position).
"""

from __future__ import annotations

from typing import Literal

import torch

from .layout import VisionLayout
from .scatter import scatter_sum, segment_rank

__all__ = [
    "BANDS",
    "Bands",
    "band_index",
    "check_bands",
    "check_window_spec",
    "grid_window_local",
    "grid_windows",
    "pseudo_square_windows",
]

Bands = Literal["proportional", "leading"]
BANDS: tuple[str, ...] = ("proportional", "leading")
"""The band rules (see the module docstring)."""


def check_bands(bands: str) -> None:
    """Raise a clear error for an unknown band rule."""
    if bands not in BANDS:
        raise ValueError(
            f"unknown bands rule {bands!r}; choose 'proportional' (lightkv) or 'leading' "
            "(reference code)"
        )


def band_index(
    r: torch.Tensor, size: torch.Tensor, bands: int | torch.Tensor, rule: str = "proportional"
) -> torch.Tensor:
    """Band of each index ``r`` on a side of ``size`` cells cut into ``min(bands, size)`` bands.

    Args:
        r: int64 indices in ``[0, size)``.
        size: int64 side lengths (broadcast with ``r``), at least 1.
        bands: bands per side (``W``; a tensor broadcast with ``r``: one per index).
        rule: ``"proportional"`` or ``"leading"`` (see the module docstring).
    """
    check_bands(rule)
    if rule == "proportional":
        n = size.clamp(max=bands)
        return torch.div(r * n, size, rounding_mode="floor")
    q = torch.div(size, bands, rounding_mode="floor")
    rem = size - q * bands
    cut = rem * (q + 1)  # rows covered by the longer leading bands
    # q == 0 (a side shorter than W): every index is before the cut, one band per cell.
    return torch.where(
        r < cut,
        torch.div(r, q + 1, rounding_mode="floor"),
        rem + torch.div(r - cut, q.clamp_min(1), rounding_mode="floor"),
    )


MAX_SIDE = 65536
"""The most tokens (or windows) an image side can have: larger values are typos, and past
2^63 they would not even fit the int64 arithmetic of the window ids."""


def check_window_spec(windows_per_side: int | None, window_size: tuple[int, int] | None) -> None:
    """Validate that exactly one of the two window specifications is given, positive and at
    most `MAX_SIDE`."""
    if (windows_per_side is None) == (window_size is None):
        raise ValueError(
            "give exactly one of windows_per_side (e.g. 4) or window_size (e.g. (6, 6))"
        )
    if windows_per_side is not None and (
        not isinstance(windows_per_side, int) or windows_per_side < 1
    ):
        raise ValueError(f"windows_per_side must be a positive integer, got {windows_per_side!r}")
    if windows_per_side is not None and windows_per_side > MAX_SIDE:
        raise ValueError(
            f"windows_per_side must be at most {MAX_SIDE} (no image side has more tokens), "
            f"got {windows_per_side}"
        )
    if window_size is not None:
        if len(window_size) != 2 or any((not isinstance(s, int)) or s < 1 for s in window_size):
            raise ValueError(
                f"window_size must be two positive integers (rows, cols), got {window_size!r}"
            )
        if max(window_size) > MAX_SIDE:
            raise ValueError(
                f"window_size sides must be at most {MAX_SIDE} tokens, got {window_size!r}"
            )


def _compact(key: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Map arbitrary non-negative keys of valid tokens to 0..K-1 (sorted key order)."""
    out = torch.full_like(key, -1)
    if valid.any():
        _, inverse = torch.unique(key[valid], sorted=True, return_inverse=True)
        out[valid] = inverse
    return out


def grid_windows(
    layout: VisionLayout,
    windows_per_side: int | None = None,
    window_size: tuple[int, int] | None = None,
    bands: str = "proportional",
    partial: bool = False,
    sides: torch.Tensor | None = None,
) -> torch.Tensor:
    """True 2-D windows on each image's grid.

    With ``windows_per_side=W`` an ``h x w`` grid is cut into ``min(W, h)`` window rows and
    ``min(W, w)`` window columns of near-equal size by the ``bands`` rule (``proportional``:
    token row ``r`` goes to window row ``floor(r * W_r / h)``; ``leading``: the reference
    code's, longer bands first); so a small image simply gets fewer windows. With
    ``window_size=(s_r, s_c)`` windows are ``s_r x s_c`` tokens (the last ones may be
    smaller).

    Args:
        layout: the batch layout.
        partial: allow a ``window_size`` larger than an image, which then gets partial
            windows (as ceil-mode pooling); otherwise that is an error.
        sides: ``[I]`` int64 windows per side of each image, in ``[1, windows_per_side]``,
            in place of ``windows_per_side`` image by image (a budget-dependent layout:
            `lightkv.policies.GridPartitioner`'s ``min_kept_per_window``).

    Returns:
        ``[B, N]`` int64 window id per token, ``-1`` for non-vision tokens.

    Raises:
        ValueError: a bad specification, or (without ``partial``) a window size larger
            than an image's grid.
    """
    local = grid_window_local(layout, windows_per_side, window_size, bands, partial, sides)
    vision = layout.vision_mask
    if not vision.any():
        return torch.full_like(layout.image, -1)
    img = layout.image.clamp_min(0)
    # Images have at most h*w windows; a key that sorts by (image, local window) is enough.
    span = (
        int((layout.image_grid[:, 0] * layout.image_grid[:, 1]).max()) if layout.num_images else 1
    )
    return _compact(img * span + local, vision)


def grid_window_local(
    layout: VisionLayout,
    windows_per_side: int | None = None,
    window_size: tuple[int, int] | None = None,
    bands: str = "proportional",
    partial: bool = False,
    sides: torch.Tensor | None = None,
) -> torch.Tensor:
    """The window of each vision token *inside its own image*, as `grid_windows` cuts it:
    ``[B, N]`` int64 in ``[0, h*w)``, raster order of windows, ``-1`` for non-vision tokens.
    Frames of one video with equal grids get equal local windows at equal places, which is
    what spatio-temporal windows build on."""
    check_window_spec(windows_per_side, window_size)
    check_bands(bands)
    vision = layout.vision_mask
    if not vision.any():
        return torch.full_like(layout.image, -1)
    img = layout.image.clamp_min(0)
    h = layout.image_grid[:, 0][img]
    w = layout.image_grid[:, 1][img]
    r, c = layout.coords[..., 0].clamp_min(0), layout.coords[..., 1].clamp_min(0)
    if windows_per_side is not None:
        side = windows_per_side if sides is None else sides.to(img.device)[img]
        n_c = w.clamp(max=side)
        wr = band_index(r, h, side, bands)
        wc = band_index(c, w, side, bands)
    else:
        assert window_size is not None  # check_window_spec: exactly one of the two
        s_r, s_c = window_size
        grid = layout.image_grid
        if not partial and layout.num_images and ((grid[:, 0] < s_r) | (grid[:, 1] < s_c)).any():
            small = grid[(grid[:, 0] < s_r) | (grid[:, 1] < s_c)][0].tolist()
            raise ValueError(
                f"window_size {tuple(window_size)} is larger than an image grid of {tuple(small)} "
                "tokens; use a smaller window_size, or windows_per_side which adapts to each image"
            )
        n_c = torch.div(w + s_c - 1, s_c, rounding_mode="floor")
        wr = torch.div(r, s_r, rounding_mode="floor")
        wc = torch.div(c, s_c, rounding_mode="floor")
    return torch.where(vision, wr * n_c + wc, torch.full_like(wr, -1))


def pseudo_square_windows(
    layout: VisionLayout, windows_per_side: int, bands: str = "leading", by_video: bool = False
) -> torch.Tensor:
    """The reference code's windows: re-pack each image's current vision tokens into a
    pseudo-square, then cut it into ``windows_per_side`` windows per side.

    Token ``k`` (0-based, in sequence order among the image's current vision tokens, ``n``
    of them) gets pseudo-coordinates ``(k // s, k % s)`` with ``s = ceil(sqrt(n))``, and
    window ``(band(row), band(col))`` with the ``bands`` rule on a side of ``s`` (the
    reference code's rule, ``leading``, by default).

    With ``by_video`` the frames of one video are packed together, as one long image (what
    the reference code does with a video).

    Returns:
        ``[B, N]`` int64 window id per token, ``-1`` for non-vision tokens.
    """
    check_window_spec(windows_per_side, None)
    check_bands(bands)
    vision = layout.vision_mask
    group = layout.image
    if by_video and layout.num_videos:
        group = torch.where(layout.video >= 0, layout.num_images + layout.video, layout.image)
    flat_img = group[vision]  # row-major over (b, n): sequence order within an image
    out = torch.full_like(layout.image, -1)
    if flat_img.numel() == 0:
        return out
    k = segment_rank(flat_img)
    n = scatter_sum(torch.ones_like(flat_img), flat_img, layout.num_images + layout.num_videos)[
        flat_img
    ]
    side = torch.ceil(torch.sqrt(n.double())).long()
    side = torch.where(side * side < n, side + 1, side)  # guard against sqrt rounding
    pr = torch.div(k, side, rounding_mode="floor")
    pc = k - pr * side
    wr = band_index(pr, side, windows_per_side, bands)
    wc = band_index(pc, side, windows_per_side, bands)
    key = (flat_img * windows_per_side + wr) * windows_per_side + wc
    out[vision] = key
    return _compact(out, vision)
