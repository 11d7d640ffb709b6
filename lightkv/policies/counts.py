"""Exact per-image token budgets for the methods that keep a fixed count (VisionZip,
DivPrune, CDPruner, DART, downsampling).

The field states these budgets as counts (64, 128 or 192 of LLaVA-1.5's 576 tokens), and a
schedule states a removal ratio ``P``; ``P = 1 - k / n`` must keep exactly ``k`` although
``(1 - 64/576) * 576`` is ``511.99999999999994`` in float64. The small tolerance here makes
it so; LightKV's own per-window budget (`lightkv.policies.Pruner.budget`) keeps the reference
code's plain ``floor``.
"""

from __future__ import annotations

import torch

from ..graph.layout import VisionLayout
from ..graph.scatter import scatter_sum

__all__ = ["EPS", "removal_count", "kept_count", "image_vision_counts"]

EPS = 1e-9
"""Slack below an integer that still counts as that integer: far above float64 rounding of
``ratio * n`` for any realistic ``n``, far below the ``1 / n`` step between budgets."""


def removal_count(n: torch.Tensor, ratio: float | torch.Tensor) -> torch.Tensor:
    """Tokens removed of ``n`` at removal ratio ``ratio``: ``floor(ratio * n + EPS)`` (int64,
    the shape of ``n``)."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64, device=n.device)
    return torch.floor(n.to(torch.float64) * ratio + EPS).long()


def kept_count(n: torch.Tensor, ratio: float) -> torch.Tensor:
    """Tokens kept of ``n`` at removal ratio ``ratio``: ``n - removal_count(n, ratio)``.

    Args:
        n: int64 counts (any shape).
        ratio: removal ratio in ``[0, 1)``.

    Returns:
        int64, same shape: at least 1 where ``n >= 1`` (a ratio below 1 never empties an image).
    """
    return torch.where(n > 0, (n - removal_count(n, ratio)).clamp_min(1), n)


def image_vision_counts(layout: VisionLayout) -> torch.Tensor:
    """``[I]`` int64: current vision tokens of each image of ``layout``."""
    vision = layout.vision_mask
    return scatter_sum(
        torch.ones_like(layout.image[vision]), layout.image[vision], layout.num_images
    )
