"""SCOPE: keep the tokens of highest saliency x coverage gain, greedily.

Deng, Li, Zhou, He, "SCOPE: Saliency-Coverage Oriented Token Pruning for Efficient
Multimodel LLMs", NeurIPS 2025 (arXiv:2510.24214); code github.com/kinredon/SCOPE
(``scope/clip_encoder.py`` at 6bf7306).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..policies.inputs import Features
from ..policies.pruners import KeepSetPruner, Pruner

__all__ = ["SCOPE"]


@Pruner.register("scope")
@dataclass
class SCOPE(KeepSetPruner):
    """Greedy maximisation of ``saliency^alpha x token-coverage gain`` in each window.

    The rule (paper, method section: the set-coverage of the selected tokens, the
    token-coverage gain of an unselected token and the SCOPE score that multiplies it by
    the token's saliency; the authors' ``SCOPE`` function, ``scope/clip_encoder.py`` lines
    140-199 of github.com/kinredon/SCOPE at 6bf7306):

    * similarity: ``s(i, j) = cos(x_i, x_j)`` of the tokens' features (line 153; there the
      vision tower's features at the layer the projector reads, ``hidden_states[-2]``,
      line 118), ``s(j, j) = 1``;
    * set-coverage of the kept set ``S``: ``C(S) = sum_i c_i`` with
      ``c_i = max(0, max_{s in S} s(i, s))`` (``cur_max``, zero-initialised, line 162,
      updated with the pick's row, line 197);
    * token-coverage gain of a candidate ``j``: ``g_j = C(S + j) - C(S) =
      sum_i max(0, s(i, j) - c_i)`` over every token ``i`` of the window (lines 174-178);
    * SCOPE score: ``g_j * a_j ** alpha`` with ``a_j`` the saliency (lines 165-167,
      ``combined == 'multi'`` line 182-183; ``alpha`` defaults to 1.0, line 165);
    * each step keeps the unselected token of highest score (``argmax``, line 192: ties
      go to the earliest token), for ``count`` steps.

    Saliency. The paper's saliency is the vision tower's CLS attention at the layer the
    projector reads, summed over heads (lines 117, 122-124). lightkv reads it as the
    stage's relevance ``inputs.relevance``, so the preset chooses it: ``scope.yaml`` uses
    ``relevance: tower_attention`` with ``heads: sum`` (the paper's; it exists on the LLaVA
    family only, other families refuse the preset); ``relevance: uniform`` makes every
    ``a_j = 1`` and the rule becomes pure facility-location coverage, which runs anywhere.

    What is the same: the coverage, the gain, the multiplicative score, ``alpha``, the
    greedy order and its tie rule. What differs: the similarity is of the stage's features
    (in the pre-LLM mode the projected embeddings, not the tower's pre-projector
    features); the kept count is each window's exact budget (`exact_removals`) instead of
    ``token_num / batch`` (line 128); each window (one image with the ``global``
    partitioner) is selected on its own, every window of the batch at once; the sum over
    ``i`` runs over the window's tokens only (padding slots take no part); similarities are
    in float32 at least.

    Attributes:
        alpha: the saliency exponent (the code's ``ALPHA``, 1.0); 0 ignores saliency.
        features: the features of the similarity: ``hidden`` or ``key_states``.
    """

    alpha: float = 1.0
    features: Features = "hidden"

    def __post_init__(self) -> None:
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not (0.0 <= float(self.alpha) < math.inf)
        ):
            raise ValueError(f"alpha must be a finite number >= 0, got {self.alpha!r}")

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features}) - {"hidden"}

    def saliency(self, inputs) -> torch.Tensor:
        """``[K, a_max]`` float64 ``a_j ** alpha`` per A slot (0 on padding)."""
        valid = inputs.graph.src_slots >= 0
        a = inputs.relevance.to(torch.float64).clamp_min(0)
        return torch.where(valid, a.pow(float(self.alpha)), torch.zeros_like(a))

    def keep(self, inputs, count):
        """``[K, a_max]`` bool: the ``count[k]`` greedy SCOPE picks of window ``k``."""
        graph = inputs.graph
        valid = graph.src_slots >= 0
        k, a = valid.shape
        kept = torch.zeros_like(valid)
        steps = int(count.max()) if k else 0
        if steps == 0:
            return kept
        x = self.unit_features(inputs, self.stage_of(inputs, "scope"), self.features)
        sim = x @ x.transpose(1, 2)  # [K, a, a]: row i = covered token, column j = candidate
        sim.diagonal(dim1=1, dim2=2).fill_(1.0)
        sim = sim.masked_fill(~valid.unsqueeze(2), 0.0)  # padding rows cover nothing
        weight = self.saliency(inputs)
        cover = torch.zeros(k, a, dtype=sim.dtype, device=sim.device)  # c_i
        windows = torch.arange(k, device=sim.device)
        for t in range(steps):
            active = count > t
            gain = (sim - cover.unsqueeze(2)).clamp_min(0).sum(dim=1).to(torch.float64)  # [K, a]
            score = (gain * weight).masked_fill(~valid | kept, -math.inf)
            j = score.argmax(dim=1)  # first maximum
            kept[windows, j] |= active
            cover = torch.maximum(cover, sim[windows, :, j].clamp_min(0))
        return kept
