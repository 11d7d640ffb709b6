"""TOPS, built from its abstract: a greedy preservation set scored by task relevance,
information coverage and semantic diversity.

Zhang et al., "TOPS: First-Principles Visual Token Pruning via Constructing Token Optimal
Preservation Sets for Efficient MLLM Inference", arXiv 2606.27161 (June 2026). No code of
theirs could be found and only the abstract is in the stores this project can read: the three
principles it names are built here as one greedy rule; every weight and form below is
lightkv's choice, listed on ``docs/methods/tops.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..policies.inputs import Features
from ..policies.pruners import KeepSetPruner, Pruner

__all__ = ["TOPS"]


@Pruner.register("tops")
@dataclass
class TOPS(KeepSetPruner):
    """``count`` greedy picks per window of the token ``j`` with the largest
    ``relevance * q_j + coverage * C_j + diversity * D_j`` (ties: the earliest token), each
    term in ``[0, 1]``:

    * task relevance ``q_j = ξ_j / max ξ`` (ξ the stage's relevance: ``question_similarity``
      in the preset, the cosine of each token to the question's tokens);
    * information coverage ``C_j = (1 / n) sum_i max(0, sim(j, i) - c_i)``, the gain of the
      facility location ``sum_i max_{s in S} sim(s, i)`` with ``sim = (cos + 1) / 2`` and
      ``c_i`` the coverage of token ``i`` so far (0 at first);
    * semantic diversity ``D_j = min_{s in S} (1 - cos(j, s)) / 2``, the distance to the
      nearest kept token (1 while nothing is kept).

    Attributes:
        relevance, coverage, diversity: the weights of the three terms (``>= 0``, not all 0;
            lightkv's choice: 1 each).
        features: the features of the similarities: ``hidden`` or ``key_states``.
    """

    reads_prompt: ClassVar[bool] = False  # the question reaches it through ξ

    relevance: float = 1.0
    coverage: float = 1.0
    diversity: float = 1.0
    features: Features = "hidden"

    def __post_init__(self) -> None:
        for name in ("relevance", "coverage", "diversity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"tops: {name} must be a finite number >= 0, got {v!r}")
        if self.relevance == self.coverage == self.diversity == 0:
            raise ValueError("tops: at least one of relevance, coverage, diversity must be > 0")

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features}) - {"hidden"}

    def keep(self, inputs, count):
        """``[K, a_max]`` bool: the ``count[k]`` greedy picks of window ``k``."""
        graph = inputs.graph
        valid = graph.src_slots >= 0
        k, a = valid.shape
        kept = torch.zeros_like(valid)
        if k == 0 or int(count.max()) == 0:
            return kept
        x = self.unit_features(inputs, self.stage_of(inputs, "tops"), self.features)
        cos = (x @ x.transpose(1, 2)).clamp(-1.0, 1.0)  # row = candidate, column = covered
        sim = (0.5 * (cos + 1.0)).masked_fill(~valid.unsqueeze(1), 0.0)
        xi = inputs.relevance.to(sim.dtype).masked_fill(~valid, 0.0).clamp_min(0.0)
        top = xi.amax(1, keepdim=True)
        q = torch.where(top > 0, xi / top.clamp_min(1e-30), torch.ones_like(xi))
        n = valid.sum(1, keepdim=True).clamp_min(1).to(sim.dtype)
        cover = sim.new_zeros(k, a)
        near = torch.ones_like(cover)  # D_j: 1 while nothing is kept
        windows = torch.arange(k, device=x.device)
        for t in range(int(count.max())):
            active = count > t
            gain = (sim - cover.unsqueeze(1)).clamp_min(0.0).sum(2) / n
            score = self.relevance * q + self.coverage * gain + self.diversity * near
            j = score.masked_fill(~valid | kept, -math.inf).argmax(dim=1)  # first maximum
            kept[windows, j] |= active
            cover = torch.maximum(cover, sim[windows, j])
            near = torch.minimum(near, 0.5 * (1.0 - cos[windows, j]))
        return kept
