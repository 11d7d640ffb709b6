"""HoloV: spread the kept budget over an image's crops by their saliency and diversity, then
keep the most salient tokens of each crop.

Zou, Lu, Wang, Yan, Lyu, Zheng, Zhang, Hu, "Don't Just Chase 'Highlighted Tokens' in MLLMs:
Revisiting Visual Holistic Context Retention", NeurIPS 2025 (arXiv:2510.02912); code
github.com/obananas/HoloV (``llava/model/utils.py``, ``HoloV``, at 1d2e65e).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..graph.scatter import scatter_sum
from ..policies.inputs import Features
from ..policies.pruners import KeepSetPruner, Pruner, allocate_removals

__all__ = ["HoloV"]


@Pruner.register("holov")
@dataclass
class HoloV(KeepSetPruner):
    """Crop budgets by holistic score, attention top-k inside each crop.

    The rule (paper, method section: the image is split into crops, each crop scored by its tokens'
    saliency plus their semantic diversity, the pruning budget distributed over crops in
    proportion to the scores; the authors' ``HoloV`` function, ``llava/model/utils.py``
    lines 22-151 of github.com/obananas/HoloV at 1d2e65e, called with ``num_patches=16``
    from ``llava/model/llava_arch.py`` line 239), per window of ``n`` tokens keeping ``T``:

    * crops: ``crops`` runs of consecutive tokens (raster order), the first ``n % crops``
      of ``n // crops + 1`` tokens, the others of ``n // crops``; empty crops are skipped
      (lines 33-50). They are runs of the flattened sequence, not 2-D tiles (at 24 x 24
      and 16 crops: one and a half grid rows each);
    * in a crop of ``c > 1`` tokens, with ``S`` the cosine similarity of
      ``x / (|x| + eps)`` and its diagonal set to 0: ``mu_i = sum_j S_ij / (c - 1)`` and
      ``v_i = sum_j (S_ij - mu_i)^2 / (c - 1)`` (the sum over ``j`` includes the zeroed
      ``j = i``; lines 69-81);
    * token score ``scale * a_i + alpha * v_i * m(|scale * a|) / (m(|v|) + eps)`` with ``a``
      the saliency, ``m`` the crop mean, ``scale = 1e3``, ``alpha = 0.09`` (lines 25, 84-92);
      the crop score is the mean token score (line 95); a one-token crop scores its
      unscaled saliency (lines 61-63);
    * weights ``w_p = score_p / (sum score + eps)``; ``floor(w_p T)`` tokens per crop; the
      ``T - sum floor`` left go one each to the crops of largest weight (lines 104-112);
    * in each crop, the tokens of highest saliency (``topk``, line 126).

    Saliency: the code's is the CLS attention of the vision tower at the layer the
    projector reads, averaged over heads (``clip_encoder.py`` ``feature_select``,
    ``llava_arch.py`` line 143). It is the stage's relevance here (``inputs.relevance``):
    the ``holov`` preset uses ``relevance: tower_attention`` with ``heads: mean``.

    Overflow. Where a crop's share exceeds its size the code keeps the whole crop, loses the
    excess and pads the image with zero vectors up to ``T`` (lines 115-143). With ``overflow =
    "pad"`` (default) so does lightkv: each crop keeps ``min(share, size)`` tokens and the
    budget's remaining slots stay as zero vectors (`Pruner.choose`'s ``zeroed``: the window's
    last tokens not kept, whose states a `lightkv.Stage` sets to 0), so the image still holds
    ``T`` tokens and its real ones are the code's. ``"spread"`` is lightkv's variant: the
    excess goes one token at a time to the crops not yet full, earliest first
    (`allocate_removals`), so ``T`` real tokens stay (with no crop overflowing both are the
    code's allocation). With a merging passer (the preset drops) a dropped token may merge into
    a padding slot and leave with it: use ``spread`` there.

    What is the same: the crops, the diversity statistic, the scores, the floor-and-top-up
    allocation, attention top-k within crops, the padding. What differs: the budget is each
    window's exact `exact_removals` count; the zero vectors sit at the places of the image's
    last dropped tokens and the kept tokens keep their places (the code concatenates the
    crops' picks, each crop's in decreasing attention, then the zeros); ties (top-up weights,
    in-crop saliency) go to the earliest; the features are the stage's (in the pre-LLM mode
    the projected embeddings, as the code's ``image_features`` after ``mm_projector``); every
    window (one image with the ``global`` partitioner) of the batch runs at once, where the
    code concatenates a LLaVA-NeXT image's base and crop features into one sequence.

    Attributes:
        crops: crops per window (the code's ``num_patches = 16``).
        alpha: weight of the diversity term (0.09).
        scale: saliency scale (1e3).
        eps: the code's ``esp`` (1e-6) in the normalisation and the ratios.
        features: ``hidden`` or ``key_states``.
        overflow: ``pad`` (the code: a full crop's excess slots become zero vectors) or
            ``spread`` (the excess goes to the crops not yet full).
    """

    crops: int = 16
    alpha: float = 0.09
    scale: float = 1e3
    eps: float = 1e-6
    features: Features = "hidden"
    overflow: Literal["pad", "spread"] = "pad"

    def __post_init__(self) -> None:
        if self.overflow not in ("pad", "spread"):
            raise ValueError(f"unknown overflow {self.overflow!r}; choose pad or spread")
        if isinstance(self.crops, bool) or not isinstance(self.crops, int) or self.crops < 1:
            raise ValueError(f"crops must be a positive integer, got {self.crops!r}")
        for name in ("alpha", "scale", "eps"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (0.0 <= float(value) < math.inf)
            ):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({self.features}) - {"hidden"}

    def crop_of(self, valid: torch.Tensor) -> torch.Tensor:
        """``[K, a_max]`` int64 crop of each A slot (``-1`` on padding): valid slots are a
        prefix of each window, cut into ``crops`` runs, the first ``n % crops`` one longer."""
        n = valid.sum(1, keepdim=True)
        q, r = n // self.crops, n % self.crops
        idx = torch.arange(valid.shape[1], device=valid.device).unsqueeze(0)
        head = r * (q + 1)  # slots in the longer crops
        crop = torch.where(idx < head, idx // (q + 1), r + (idx - head) // q.clamp_min(1))
        return torch.where(valid, crop, torch.full_like(crop, -1))

    def allocation(self, inputs, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([K, a_max] crop per slot, [K, crops] int64 tokens kept per crop)``."""
        graph = inputs.graph
        stage = self.stage_of(inputs, "holov")
        valid = graph.src_slots >= 0
        k, a = valid.shape
        p = self.crops
        dev = valid.device
        crop = self.crop_of(valid)
        f = graph.token_blocks(stage.features(self.features), "src").flatten(2)
        f = f.to(torch.promote_types(f.dtype, torch.float32)).to(torch.float64)
        x = f / (f.norm(dim=-1, keepdim=True) + self.eps)
        same = (
            (crop.unsqueeze(2) == crop.unsqueeze(1)) & valid.unsqueeze(2) & valid.unsqueeze(1)
        )  # [K, a, a]
        eye = torch.eye(a, dtype=torch.bool, device=dev)
        s = (x @ x.transpose(1, 2)).masked_fill(~same | eye, 0.0)
        flat = (torch.arange(k, device=dev).unsqueeze(1) * p + crop.clamp_min(0)).masked_fill(
            ~valid, k * p
        )  # [K, a]
        size = scatter_sum(valid.long().flatten(), flat.flatten(), k * p + 1)[: k * p].view(
            k, p
        )  # [K, P]
        c = size.gather(1, crop.clamp_min(0)).to(torch.float64)  # [K, a]: own crop's size
        div = (c - 1).clamp_min(1)
        mu = s.sum(2) / div
        v = ((s - mu.unsqueeze(2)).pow(2) * same).sum(2) / div
        att = inputs.relevance.to(torch.float64).masked_fill(~valid, 0.0)
        att_s = att * self.scale

        def crop_mean(t: torch.Tensor) -> torch.Tensor:  # [K, a] -> [K, P]
            total = scatter_sum(t.masked_fill(~valid, 0.0).flatten(), flat.flatten(), k * p + 1)[
                : k * p
            ].view(k, p)
            return total / size.clamp_min(1).to(torch.float64)

        ratio = crop_mean(att_s.abs()) / (crop_mean(v.abs()) + self.eps)  # [K, P]
        token = att_s + self.alpha * v * ratio.gather(1, crop.clamp_min(0))
        score = torch.where(
            size > 1, crop_mean(token), crop_mean(att)
        )  # one-token crops: unscaled saliency
        present = size > 0
        score = score.masked_fill(~present, 0.0)
        w = score / (score.sum(1, keepdim=True) + self.eps)
        base = torch.floor(w * count.unsqueeze(1).to(torch.float64)).long()
        left = (count - base.sum(1)).clamp_min(0)  # [K]
        order = torch.sort(
            -w.masked_fill(~present, -math.inf), dim=1, stable=True
        ).indices  # largest weight first
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(p, device=dev).expand_as(order))
        base = base + ((rank < left.unsqueeze(1)) & present).long()
        if self.overflow == "pad":  # a crop keeps at most its size; the rest become zero vectors
            return crop, torch.minimum(base, size)
        group = torch.arange(k, device=dev).repeat_interleave(p)
        kept = allocate_removals(
            base.flatten().to(torch.float64), size.flatten(), group, count
        ).view(k, p)
        return crop, kept

    def choose(self, inputs, ratio):
        """``(removed, zeroed)``: with ``overflow = "pad"`` the slots a full crop could not use
        stay as zero vectors: the window's last slots not kept (slots in sequence order)."""
        valid = inputs.graph.src_slots >= 0
        removals = self.removals(inputs, ratio)
        if not bool((removals > 0).any()):
            return torch.zeros_like(valid), None
        count = valid.sum(1) - removals
        kept = self.keep(inputs, count)
        free = valid & ~kept
        after = free.flip(1).long().cumsum(1).flip(1)  # free slots at or after each slot
        pads = free & (after <= (count - kept.sum(1)).unsqueeze(1))
        return free & ~pads, pads

    def select(self, inputs, ratio):
        return self.choose(inputs, ratio)[0]

    def keep(self, inputs, count):
        """``[K, a_max]`` bool: per crop, its share of ``count[k]`` by saliency (with
        ``overflow = "pad"`` fewer where a crop's share exceeds its size)."""
        valid = inputs.graph.src_slots >= 0
        k, a = valid.shape
        if k == 0 or int(count.max()) == 0:
            return torch.zeros_like(valid)
        crop, share = self.allocation(inputs, count)
        att = inputs.relevance.to(torch.float64)
        idx = torch.arange(a, device=valid.device)
        # rank inside the crop: higher saliency first, ties to the earlier slot
        before = (att.unsqueeze(1) > att.unsqueeze(2)) | (
            (att.unsqueeze(1) == att.unsqueeze(2)) & (idx < idx.unsqueeze(1))
        )
        before &= (crop.unsqueeze(1) == crop.unsqueeze(2)) & valid.unsqueeze(1)
        rank = before.sum(2)  # [K, a]: row i counts the j ranked before it
        return valid & (rank < share.gather(1, crop.clamp_min(0)))
