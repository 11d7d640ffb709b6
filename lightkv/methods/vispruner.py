"""VisPruner: keep the tokens the vision encoder marks as important, then the most distinct
of the rest.

Zhang et al., "Beyond Text-Visual Attention: Exploiting Visual Cues for Effective Token
Pruning in VLMs", ICCV 2025 (arXiv:2412.01818); code github.com/Theia-4869/VisPruner
(read as anonymous-4869/VisPruner @d01c757).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..policies.inputs import Features
from ..policies.pruners import KeepSetPruner, Pruner

__all__ = ["VisPruner"]


def _compact(index: torch.Tensor) -> torch.Tensor:
    """``[K, L]`` slot indices with ``-1`` holes -> the same entries, holes moved to the end
    (order of the others kept)."""
    order = torch.sort((index < 0).to(torch.int8), dim=1, stable=True).indices
    return index.gather(1, order)


@Pruner.register("vispruner")
@dataclass
class VisPruner(KeepSetPruner):
    """Important tokens by the stage's relevance, then diverse tokens by repeated
    bipartite de-duplication.

    The rule of ``encode_images`` in the authors' ``llava/model/llava_arch.py`` (VisPruner
    section, lines 140-170 at d01c757), per window keeping ``T`` tokens:

    * important: the ``floor(important * T)`` tokens of highest relevance (there the CLS
      attention of the vision tower averaged over heads: `lightkv.policies.TowerAttention`
      with ``heads: mean``), ``argsort(descending=True)``; ties here go to the earlier token;
    * the rest, in that descending order, is the residual list; while it holds more than
      ``T_div = T - T_imp`` tokens: ``r = min(step, R - T_div)``; its even positions form
      side *a* and its odd positions side *b*; each *a* token scores its highest cosine
      similarity to any *b* token; the ``r`` highest-scoring *a* tokens leave; the new list
      is the remaining *a* tokens in descending score order, then every *b* token;
    * the kept set is the important tokens plus the final residual list.

    What differs: the features are the stage's (in the pre-LLM mode the projected
    embeddings; the code compares the tower's output features before the projector), ties
    in the importance ranking go to the earlier token, and every window (image) of the
    batch runs at once with its own exact budget (`exact_removals`).

    Attributes:
        important: share of the kept tokens chosen by relevance (the code's 0.5).
        step: the most tokens one de-duplication round removes (the code's 8).
        features: ``hidden`` or ``key_states``.
    """

    important: float = 0.5
    step: int = 8
    features: Features = "hidden"

    def __post_init__(self) -> None:
        if (
            isinstance(self.important, bool)
            or not isinstance(self.important, (int, float))
            or not (0.0 <= float(self.important) <= 1.0)
        ):
            raise ValueError(f"important must be a share in [0, 1], got {self.important!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 1:
            raise ValueError(f"step must be a positive integer, got {self.step!r}")

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features}) - {"hidden"}

    def keep(self, inputs, count):
        """``[K, a_max]`` bool: ``count[k]`` slots per window (important, then diverse)."""
        graph = inputs.graph
        x = self.unit_features(inputs, self.stage_of(inputs, "vispruner"), self.features)
        valid = graph.src_slots >= 0
        k, a = valid.shape
        kept = torch.zeros_like(valid)
        if k == 0 or a == 0:
            return kept
        n_imp = torch.floor(count.double() * float(self.important)).long()
        n_div = count - n_imp
        xi = inputs.relevance.to(torch.float64).masked_fill(~valid, -math.inf)
        order = torch.sort(-xi, dim=1, stable=True).indices  # by relevance, descending; holes last
        rank = torch.arange(a, device=x.device).expand(k, a)
        kept.scatter_(1, order, rank < n_imp.unsqueeze(1))
        # residual list: the rest of the ranking, holes (-1) at the end
        residual = _compact(
            torch.where((rank >= n_imp.unsqueeze(1)) & valid.gather(1, order), order, -1)
        )
        windows = torch.arange(k, device=x.device).unsqueeze(1)
        # every round compares some residual tokens with others: one Gram matrix up front, then
        # gathers (the rounds' own matmuls cost ~R/8 times as much at 7B width)
        gram = x @ x.transpose(1, 2)  # [K, a, a]
        while True:
            size = (residual >= 0).sum(1)
            r = torch.clamp(size - n_div, max=self.step)
            if not bool((r > 0).any()):
                break
            side_a, side_b = residual[:, 0::2], residual[:, 1::2]
            rows = gram.gather(1, side_a.clamp_min(0).unsqueeze(2).expand(-1, -1, a))  # [K, |a|, a]
            sim = rows.gather(2, side_b.clamp_min(0).unsqueeze(1).expand(-1, side_a.shape[1], -1))
            sim = sim.masked_fill((side_b < 0).unsqueeze(1), -math.inf)
            score = (
                sim.amax(dim=2)
                if sim.shape[2]
                else torch.full(side_a.shape, -math.inf, device=x.device)
            )
            score = score.masked_fill(side_a < 0, -math.inf)
            desc = torch.sort(-score, dim=1, stable=True).indices
            pos = torch.arange(desc.shape[1], device=x.device).expand_as(desc)
            survivors = torch.where(pos >= r.clamp_min(0).unsqueeze(1), side_a.gather(1, desc), -1)
            residual = _compact(torch.cat([survivors, side_b], dim=1))
        kept[windows.expand_as(residual)[residual >= 0], residual[residual >= 0]] = True
        return kept & valid
