"""Deterministic per-token pseudo-random numbers.

Random policies (random split, random pruning) must give a row the same result whether it
runs alone or inside a batch, and the same result on every run. A global RNG stream
cannot do that (it depends on how many tokens came before), so they hash each token's
identity instead: its image's index within its own row and its ``(row, col)`` on the grid.
"""

from __future__ import annotations

import torch

from ..graph.layout import VisionLayout
from ..graph.scatter import segment_rank

__all__ = ["token_identity", "seeded_uniform", "seeded_uniform_pairs"]

_MASK = (1 << 62) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    # Multiply-xorshift rounds on int64, masked below 2**62 so values stay non-negative;
    # good enough to decorrelate neighbouring grid cells.
    for mult in (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D):
        x = (x ^ (x >> 17)) & _MASK
        x = (x * mult) & _MASK
    return x


def token_identity(layout: VisionLayout) -> torch.Tensor:
    """``[B, N]`` int64 identity of every token that does not depend on the rest of the
    batch: (image index within its row, row, col) for image tokens, the original sequence
    index otherwise."""
    if layout.num_images == 0:
        return layout.origin.clamp_min(0)
    local_image = segment_rank(layout.image_row)
    img = torch.where(
        layout.image >= 0, local_image[layout.image.clamp_min(0)], torch.full_like(layout.image, -1)
    )
    r, c = layout.coords[..., 0], layout.coords[..., 1]
    return torch.where(
        img >= 0, ((img + 1) << 40) + ((r + 1) << 20) + (c + 1), layout.origin.clamp_min(0)
    )


def seeded_uniform_pairs(
    rows: torch.Tensor, cols: torch.Tensor, heads: int, seed: int, first_head: int = 0
) -> torch.Tensor:
    """Float64 in ``[0, 1)``, ``[B, heads, N, T]``: one draw per (row token, column token,
    head), keyed by the identities ``rows`` (``[B, N]``) and ``cols`` (``[B, T]``), fixed for
    a given ``seed``: what ``torch.rand_like`` of an attention-score tensor draws, without a
    global RNG stream (so a row draws the same alone or inside a batch). ``first_head``
    offsets the heads: the draws of heads ``first_head .. first_head + heads - 1`` of a
    larger head count (a block of it)."""
    h = torch.arange(first_head + 1, first_head + heads + 1, device=rows.device, dtype=torch.int64)
    row = _mix(rows & _MASK)[:, None, :, None]
    col = _mix(_mix(cols & _MASK) ^ 0x2545F4914F6CDD1D & _MASK)[
        :, None, None, :
    ]  # not row's hash: (i, j) != (j, i)
    head = _mix((h << 32) & _MASK)[None, :, None, None]
    return seeded_uniform(row ^ _mix(col ^ head), seed)


def seeded_uniform(identity: torch.Tensor, seed: int) -> torch.Tensor:
    """Float64 in ``[0, 1)`` per element of ``identity``, fixed for a given ``seed``."""
    # the seed's hash is one number: mixed once, not once per element (the same bits)
    key = _mix(torch.tensor((seed & _MASK) + 0x632BE5AB, dtype=torch.int64, device=identity.device))
    h = _mix(_mix(identity & _MASK) ^ key)
    return (h >> 9).double() / float(1 << 53)
