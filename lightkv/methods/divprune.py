"""DivPrune: keep the most diverse tokens of a window (max-min diversity, greedy).

Alvar, Singh, Akbari, Zhang, "DivPrune: Diversity-based Visual Token Pruning for Large
Multimodal Models", CVPR 2025 (arXiv:2503.02175); code github.com/vbdi/divprune.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..policies.inputs import Features
from ..policies.pruners import KeepSetPruner, Pruner

__all__ = ["DivPrune"]


@Pruner.register("divprune")
@dataclass
class DivPrune(KeepSetPruner):
    """Greedy farthest-point selection on the cosine distance ``d(i, j) = 1 - cos(x_i, x_j)``.

    The rule of the authors' code (``LLaVA/llava/model/llava_arch.py``, ``DivPrune``,
    lines 152-171 of github.com/vbdi/divprune at 799e2d9):

    * distances ``1 - cos`` of the features (line 155; there the projected image features,
      i.e. the LLM's input embeddings, lines 374-375);
    * first pick: the token whose nearest *other* token is farthest,
      ``argmax_j min_{i != j} d(i, j)`` (line 165: the second smallest distance of each
      column, the smallest being the token to itself);
    * every next pick: the token farthest from the kept set,
      ``argmax_j min_{i in S} d(i, j)`` (line 167);
    * ties: the earliest token (``torch.argmax``, line 169, returns the first maximum).

    What differs: the kept count is lightkv's exact budget (`exact_removals`: keep
    ``n_w - floor(P n_w + 1e-9)``) instead of ``round(ratio * n)`` (line 153); the first
    pick excludes the token itself by index, not by the second smallest value (the same up
    to float error in ``1 - cos(x, x)``); a kept token is never picked again (the code could
    re-pick one when every remaining distance is 0, keeping fewer tokens); each window (one
    per image with the ``global`` partitioner) is selected on its own, all windows of the
    batch at once.

    Attributes:
        features: ``hidden`` (the residual stream; in the pre-LLM mode the input embeddings,
            as the paper) or ``key_states`` (the layer's keys, heads concatenated).
    """

    features: Features = "hidden"

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features}) - {"hidden"}

    def keep(self, inputs, count):
        """``[K, a_max]`` bool: the ``count[k]`` greedy max-min picks of window ``k``."""
        graph = inputs.graph
        x = self.unit_features(inputs, self.stage_of(inputs, "divprune"), self.features)
        valid = graph.src_slots >= 0
        k, a = valid.shape
        kept = torch.zeros_like(valid)
        steps = int(count.max()) if k else 0
        if steps == 0:
            return kept
        dist = 1.0 - x @ x.transpose(1, 2)  # [K, a, a], row i = kept token, column j = candidate
        self_or_pad = torch.eye(a, dtype=torch.bool, device=x.device) | ~valid.unsqueeze(2)
        # Nearest other token of each candidate (min over the rows of its column).
        score = dist.masked_fill(self_or_pad, math.inf).amin(dim=1)
        windows = torch.arange(k, device=x.device)
        for t in range(steps):
            active = count > t  # windows that still pick
            j = score.masked_fill(~valid | kept, -math.inf).argmax(dim=1)  # first maximum
            kept[windows, j] |= active
            picked = dist[windows, j]  # [K, a]: distance of every candidate to the new pick
            score = picked if t == 0 else torch.minimum(score, picked)
        return kept
