"""ERA, built from its description: an entropy-guided relevance share in a diversity
selection, merge into the nearest kept anchor, and a saliency-weighted log-size bias.

"Entropy-Guided Visual Token Pruning with Rectified Attention", arXiv 2606.31982 (June 2026).
No code is released, and the paper's text is not in the stores this project can read: what
is built here follows the one-paragraph description in ``shared/design/field-2026.md`` and
issue 49 ("selects by diversity and entropy, merges into the nearest kept anchor and adds a
saliency-weighted log-size bias"); every rule below that the description does not fix is
lightkv's choice, listed on ``docs/methods/era.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..policies.passers import MessagePasser, SizeWeightedMean
from ..policies.pruners import Pruner
from .lightkv import RelevanceCoverage

__all__ = ["ERA", "SaliencySizes"]


@Pruner.register("era")
@dataclass
class ERA(RelevanceCoverage):
    """Relevance-first picks, as many as the saliency's concentration calls for, then
    max-min diversity (`RelevanceCoverage` with a share per window).

    With ``p_i = ξ_i / sum ξ`` the window's saliency as a distribution (ξ the stage's
    relevance, ``question_similarity`` in the preset) and ``H = -sum p log p`` its entropy,
    the window's relevance share is ``1 - H / log n`` (``n`` its tokens): a flat saliency
    (the question points nowhere) spends the whole budget on diversity, a saliency
    concentrated on a few tokens keeps those first. The remaining picks are farthest-point
    (DivPrune's max-min) from the relevant ones. A window of one token, or with uniform ξ,
    makes no relevance picks.

    Attributes:
        share: not used (the share is computed per window); kept for the parent's checks.
        power, spatial, features: as `RelevanceCoverage` (defaults: plain max-min diversity
            in cosine distance).
    """

    share: float = 0.0

    def relevant_counts(self, xi, valid, count):
        """``[K]`` ``ceil((1 - H / log n) * count)`` per window."""
        xi = xi.masked_fill(~valid, 0.0)
        p = xi / xi.sum(1, keepdim=True).clamp_min(1e-300)
        ent = -(p * torch.log(p.clamp_min(1e-300))).sum(1)
        n = valid.sum(1).double()
        share = torch.where(n > 1, 1.0 - ent / torch.log(n.clamp_min(2.0)), torch.zeros_like(n))
        picks = torch.ceil(count.double() * share.clamp(0.0, 1.0) - 1e-9).long().clamp_min(0)
        return torch.minimum(picks, count)


@MessagePasser.register("saliency_sizes")
@dataclass
class SaliencySizes(SizeWeightedMean):
    """Size-weighted mean (ToMe's merge), and a size that counts each merged token by its
    saliency relative to its anchor: ``s_j = 1 + sum_{i -> j} min(1, ξ_i / ξ_j)`` (over the
    original tokens merged into ``j``), so proportional attention's ``log s_j`` is weighted
    by saliency. A background token merged into a salient anchor adds little attention
    mass; a duplicate as salient as its anchor adds a whole token (ToMe's ``log s``).

    Why here. lightkv's proportional attention reads the sizes of the stage's provenance
    (``Provenance.sizes``): this passer sets the provenance's per-token weights, so every
    route (mask, channel, flex) and decode carry the weighted bias with no change of their
    own.
    """

    def reweigh(self, provenance, relevance, src, dst):
        """Each original token owned by a merged row ``i`` (``src``) counts
        ``min(1, ξ_i / ξ_{dst(i)})`` from now on (``relevance [B * N]``)."""
        if src.numel() == 0:
            return provenance
        b, n = provenance.owner.shape[0], provenance.current_len
        xi = relevance.to(torch.float64)
        factor = torch.ones(b * n, dtype=torch.float64, device=relevance.device)
        ratio = xi[src] / xi[dst].clamp_min(torch.finfo(torch.float64).tiny)
        factor[src] = torch.nan_to_num(ratio, nan=1.0, posinf=1.0).clamp(0.0, 1.0)
        owner = provenance.owner
        f = factor.view(b, n).gather(1, owner.clamp_min(0))
        f = torch.where(owner >= 0, f, torch.ones_like(f))
        weight = f if provenance.weight is None else provenance.weight.to(f.dtype) * f
        return replace(provenance, weight=weight)
