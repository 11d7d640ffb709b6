"""Pruners: which tokens leave the sequence at a stage.

A pruner ranks the A tokens of every window by a removal key (lower leaves first) and
removes the ``r`` lowest per window. The budget is LightKV's
``r = min(floor(P * n_w), |A_w|)``, where ``n_w`` counts the window's A and B tokens; for
pruners that merge into a partner (``needs_partner``), a window without B tokens removes
nothing. The divergence pruners can instead cap at ``floor(n_w / 2)`` (``cap: half``), the
reference code's rule: with a parity split ``|A_w| = ceil(n_w / 2)``, so the two differ only
for odd windows at ``P > 0.5`` (288 tokens at P = 0.75: 145 left with ``sources``, 143 with
``half``). `RelevanceBudget` keeps each image's total but moves removals between its
windows by relevance (`allocate_removals` rounds the shares).

The subset pruners (`KeepSetPruner`: DivPrune, CDPruner, DART) choose the kept tokens of a
window jointly instead of ranking them by a key; they keep exactly ``k = n_w - r_w`` tokens
with ``r_w = exact_removals(graph, ratio)``.
"""

from __future__ import annotations

from .all_sources import AllSources
from .base import PruneInputs, Pruner
from .divergence import RelevanceAwareDivergence, SmallestDivergence
from .keep_set import KeepSetPruner, exact_removals
from .lowest_relevance import LowestRelevance
from .random_pruner import RandomPruner
from .relevance_budget import RelevanceBudget, allocate_removals

__all__ = [
    "Pruner",
    "PruneInputs",
    "SmallestDivergence",
    "RelevanceAwareDivergence",
    "LowestRelevance",
    "RandomPruner",
    "AllSources",
    "RelevanceBudget",
    "allocate_removals",
    "exact_removals",
    "KeepSetPruner",
]
