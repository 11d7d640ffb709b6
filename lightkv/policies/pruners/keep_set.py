"""The subset pruners' base: `KeepSetPruner` chooses a window's kept tokens jointly
(DivPrune, CDPruner, DART, ...), with the exact budget `exact_removals`."""

from __future__ import annotations

from typing import ClassVar

import torch

from ...graph.bipartite import BipartiteGraph
from ..counts import removal_count
from ..inputs import StageInputs
from .base import PruneInputs, Pruner

__all__ = ["KeepSetPruner", "exact_removals"]


def exact_removals(graph: BipartiteGraph, ratio: float | torch.Tensor) -> torch.Tensor:
    """``[K]`` int64 removals per window for the subset pruners:
    ``r_w = min(floor(ratio * n_w + EPS), |A_w|)`` (`lightkv.policies.counts.removal_count`,
    which `lightkv.policies.counts.kept_count` uses for whole images).

    A budget stated as "keep ``k`` of ``n``" is ``ratio = 1 - k / n``; without the epsilon
    the float error of that expression can make the floor one short (it keeps ``k + 1``).
    """
    return torch.minimum(removal_count(graph.window_size, ratio).clamp_min(0), graph.src_count)


class KeepSetPruner(Pruner):
    """Base of the pruners that choose a window's *kept* set jointly (DivPrune, CDPruner,
    DART): override `keep`. No partners (``needs_partner = False``): with ``drop`` what they
    do not keep leaves; with a merging passer it merges into its most similar survivor
    (`lightkv.policies.EdgeScorer.match_survivors`). The budget is `exact_removals`: every
    window keeps exactly ``|A_w| - r_w`` of its A tokens (with ``split: all_src``: of all its
    tokens). Only A tokens compete; B tokens, if a split makes any, always stay.
    """

    needs_partner: ClassVar[bool] = False

    def keep(self, inputs: PruneInputs, count: torch.Tensor) -> torch.Tensor:
        """``[K, a_max]`` bool: in each window, exactly ``count[k]`` (``[K]`` int64) valid A
        slots that stay. Never true on padding slots (``graph.src_slots < 0``)."""
        raise NotImplementedError

    def budget(self, graph, ratio):
        """``[K]``: `exact_removals`."""
        return exact_removals(graph, ratio)

    def removals(self, inputs: PruneInputs, ratio: float) -> torch.Tensor:
        """``[K]`` int64 tokens each window loses: `budget` (a pruner whose count depends on
        more than the graph, e.g. exact per image over several windows, overrides this)."""
        return self.budget(inputs.graph, ratio)

    def select(self, inputs, ratio):
        """``[K, a_max]`` bool: the valid A slots that `keep` does not keep."""
        valid = inputs.graph.src_slots >= 0
        removals = self.removals(inputs, ratio)
        if not bool((removals > 0).any()):
            return torch.zeros_like(valid)
        kept = self.keep(inputs, valid.sum(1) - removals)
        return valid & ~kept

    @staticmethod
    def stage_of(inputs: PruneInputs, who: str) -> StageInputs:
        """``inputs.stage``, or a clear error for a pruner called without it."""
        if inputs.stage is None:
            raise ValueError(f"the {who} pruner reads the stage's features: pass PruneInputs.stage")
        return inputs.stage

    @staticmethod
    def unit_features(inputs: PruneInputs, stage: StageInputs, kind: str) -> torch.Tensor:
        """``[K, a_max, F]`` the A tokens' features (heads flattened), L2-normalised, in
        float32 at least (bf16 cosines are too coarse to rank near-duplicates); zero on
        padding slots."""
        return KeepSetPruner.unit_rows(inputs.graph.token_blocks(stage.features(kind), "src"))

    @staticmethod
    def unit_rows(t: torch.Tensor) -> torch.Tensor:
        """``[K, P, *F]`` -> ``[K, P, F]``: each row flattened, in float32 at least,
        L2-normalised (zero rows stay zero)."""
        t = t.flatten(2).to(torch.promote_types(t.dtype, torch.float32))
        return t / t.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(t.dtype).tiny)
