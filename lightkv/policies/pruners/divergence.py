"""The divergence pruners: remove the A tokens closest to their best partner
(`SmallestDivergence`), optionally weighing prompt relevance in (`RelevanceAwareDivergence`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .base import Pruner

__all__ = ["SmallestDivergence", "RelevanceAwareDivergence"]


@Pruner.register("divergence")
@dataclass
class SmallestDivergence(Pruner):
    """Remove the A tokens closest to their best partner.

    LightKV's candidate set (Chen, Guo, Zimmermann, TMLR 2026, arXiv:2605.00789) and
    ToMe's bipartite soft matching (Bolya et al., ICLR 2023, arXiv:2210.09461).

    Attributes:
        cap: the most a window loses: ``sources`` (all of side A) or ``half``
            (``floor(n_w / 2)``, the reference code's cap).
        budget_dtype: ``float64`` (``floor(P * n_w)`` on the exact product) or ``float32``
            (the released code's float32 product, truncated: one more token can leave
            where ``P * n_w`` is just below an integer; the ``lightkv-paper*`` presets).
    """

    cap: Literal["sources", "half"] = "sources"
    budget_dtype: Literal["float64", "float32"] = "float64"

    def key(self, inputs):
        return inputs.divergence


@Pruner.register("relevance_divergence")
@dataclass
class RelevanceAwareDivergence(Pruner):
    """Remove tokens that are both redundant and irrelevant to the prompt.

    ``key = divergence + weight * relevance / max relevance in the window``: at equal
    divergence, the token the prompt cares less about leaves first.

    Attributes:
        weight: how much relevance counts next to divergence (0 = `SmallestDivergence`).
        cap: as `SmallestDivergence`.
    """

    weight: float = 0.5
    cap: Literal["sources", "half"] = "sources"

    def key(self, inputs):
        xi = inputs.relevance.to(torch.float64)
        top = xi.max(dim=1, keepdim=True).values.clamp_min(1e-30)
        return inputs.divergence.to(torch.float64) + self.weight * xi / top
