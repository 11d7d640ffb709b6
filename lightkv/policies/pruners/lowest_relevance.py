"""`LowestRelevance`: remove the tokens the prompt attends to least (FastV, PyramidDrop)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import Pruner

__all__ = ["LowestRelevance"]


@Pruner.register("lowest_relevance")
@dataclass
class LowestRelevance(Pruner):
    """Remove the tokens with the lowest prompt relevance (attention top-k).

    FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2", ECCV 2024,
    arXiv:2403.06764) and PyramidDrop (Xing et al., CVPR 2025, arXiv:2410.17247). Needs no
    partner: combine with the ``drop`` message passer.
    """

    needs_partner: ClassVar[bool] = False

    def key(self, inputs):
        return inputs.relevance
