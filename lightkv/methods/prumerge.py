"""PruMerge+: keep the tokens the vision tower's CLS attends to as outliers, add spatially
uniform samples, and fold what is pruned into one extra token.

Shang, Cai, Xu, Lee, Yan, "LLaVA-PruMerge: Adaptive Token Reduction for Efficient Large
Multimodal Models" (arXiv:2403.15388); code github.com/42Shawn/LLaVA-PruMerge
(``llava/model/multimodal_encoder/clip_encoder.py``,
``CLIPVisionTower.token_prune_merge_advanced_plus``, read at 097c041).

Also home of the pieces TRIM shares (`lightkv.methods.trim`): the interquartile-range
outlier count (`iqr_count`), the partition that keeps a chosen set and pools every other
token of the image into one (`keep_and_pool`), and the adaptive pre-LLM schedule
(``pre_llm_adaptive``) under which the method decides its own count until the
kept-fraction knob fixes one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..policies.counts import image_vision_counts, kept_count
from ..policies.partitioners import Partition, Partitioner
from ..policies.passers import MessagePasser
from ..policies.schedulers.core import Scheduler, StageSpec
from ..policies.schedulers.pre_llm import PreLLMSchedule

__all__ = [
    "AdaptivePreLLM",
    "AdaptiveSpec",
    "PruMergePlus",
    "WeightedSum",
    "iqr_count",
    "keep_and_pool",
]


def iqr_count(values: torch.Tensor) -> int:
    """How many of ``values [m]`` lie above ``Q3 + 1.5 IQR`` (quartiles by linear
    interpolation, as ``numpy.percentile``; in float32, as both authors' codes compute it),
    returned as both codes turn it into a count: ``int(m * (outliers / m))``."""
    v = values.detach().to(torch.float32).flatten().cpu()
    m = v.numel()
    if m == 0:
        return 0
    q1, q3 = torch.quantile(v, torch.tensor([0.25, 0.75])).unbind()
    outliers = int((v > q3 + 1.5 * (q3 - q1)).sum())
    return int(m * (outliers / m))


def keep_and_pool(layout, kept: torch.Tensor) -> Partition:
    """A partition that keeps the vision tokens ``kept [M]`` (bool over ``layout``'s vision
    tokens in sequence order) outside the graph and pools the others of each image into one
    token: the image's last token not kept is the target (side B), every other token not
    kept a source (side A). An image that keeps every token is left alone."""
    vision = layout.vision_mask
    part = Partition.empty(layout)
    img = layout.image[vision]
    rest = ~kept
    if not bool(rest.any()):
        return part
    pos = torch.arange(img.numel(), device=img.device)
    last = torch.full((layout.num_images,), -1, dtype=torch.long, device=img.device)
    last = last.scatter_reduce(0, img[rest], pos[rest], reduce="amax")
    host = torch.zeros_like(rest)
    host[last[last >= 0]] = True
    window = torch.where(rest, img, torch.full_like(img, -1))
    used = torch.unique(window[rest], sorted=True, return_inverse=True)[1]
    window[rest] = used
    part.window[vision] = window
    part.is_src[vision] = rest & ~host
    return part


@dataclass(frozen=True)
class AdaptiveSpec(StageSpec):
    """A pre-LLM stage whose method may choose its own kept count (``adaptive``); its
    ``removal_ratio`` is then only what a dry run reports."""

    adaptive: bool = True


@Scheduler.register("pre_llm_adaptive")
@dataclass
class AdaptivePreLLM(PreLLMSchedule):
    """`lightkv.policies.PreLLMSchedule` for methods whose count is adaptive (PruMerge+'s and
    TRIM's outliers): with ``adaptive`` the stage's partitioner decides how many tokens an
    image keeps and ``removal_ratio`` is the share the dry run reports; the kept-fraction
    knob turns ``adaptive`` off, so the stage keeps exactly ``1 - removal_ratio``, chosen by
    the method's fixed-count rule.

    Attributes:
        adaptive: the method's own count (True) or the exact budget (False).
    """

    adaptive: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")

    def plan(self, num_layers):
        return [AdaptiveSpec(**vars(s), adaptive=self.adaptive) for s in super().plan(num_layers)]

    def at_kept_fraction(self, kept_fraction, num_layers, max_removal_ratio=1.0):
        """`PreLLMSchedule.at_kept_fraction` with the exact budget (``adaptive`` off)."""
        fixed = super().at_kept_fraction(kept_fraction, num_layers, max_removal_ratio)
        return replace(fixed, adaptive=False)

    def knob(self) -> str:
        return (
            "the count of its one stage before the LLM: the method's adaptive (outlier) count "
            "becomes an exact 1 - kept_fraction"
        )


def adaptive(inputs) -> bool:
    """Whether the stage's method chooses its own count (an `AdaptiveSpec` with ``adaptive``)."""
    return bool(getattr(inputs.spec, "adaptive", False))


@Partitioner.register("prumerge_plus")
@dataclass
class PruMergePlus(Partitioner):
    """PruMerge+'s kept set per image, from the stage's relevance (the CLS attention in the
    vision tower: the ``tower_attention`` relevance).

    The authors' rule (``token_prune_merge_advanced_plus``, lines 198-214 at 097c041), on an
    image's ``n`` patches with CLS attention ``a``:

    * outliers: ``c`` = the number of ``a_i > Q3 + 1.5 IQR`` (``outlier_dectection``), the
      ``int(n * c / n)`` largest ``a`` kept (``torch.topk``);
    * spatial samples: with ``step = int(n / c)`` (``int(1 / ratio)``), the patches
      ``0, s, 2 s, ... < n - 1`` with ``s = int(step / 3)`` are kept too (the code's
      ``arange(0, 575, ...)``: ``n - 1`` for LLaVA-1.5's 576 patches);
    * the rest are pruned; the passer folds them into one extra token (`WeightedSum`: the
      code's ``sum(a_j x_j)`` over the pruned patches).

    Where the code cannot run, lightkv decides: no outlier (the code divides by zero) keeps
    the whole image; ``s = 0`` (more than a third of the patches are outliers: the code's
    ``arange`` fails) samples every patch.

    Under the kept-fraction knob (the stage's spec not `AdaptiveSpec.adaptive`) an image
    keeps exactly ``k = n - floor(P n)``, one of them the extra token: the
    ``round((k - 1) / 4)`` patches of largest ``a`` (the adaptive rule's share: its samples
    are about three times its outliers) and evenly spaced patches of the rest,
    ``0, r, 2 r, ...`` with ``r = R // need`` among the ``R`` others in sequence order.
    """

    def partition(self, inputs):
        layout = inputs.layout
        vision = layout.vision_mask
        if not bool(vision.any()):
            return Partition.empty(layout)
        if inputs.relevance is None:
            raise ValueError(
                "prumerge_plus ranks by the vision tower's CLS attention: give the stage a "
                "relevance (tower_attention)"
            )
        img = layout.image[vision]
        a_all = inputs.relevance[vision]
        n_img = image_vision_counts(layout)
        budget = kept_count(n_img, inputs.spec.removal_ratio)
        kept = torch.zeros_like(img, dtype=torch.bool)
        for i in range(layout.num_images):
            where = torch.nonzero(img == i).flatten()
            n = where.numel()
            if n == 0:
                continue
            a = a_all[where]
            pick = self.adaptive_keep(a) if adaptive(inputs) else self.fixed_keep(a, budget[i])
            kept[where[pick]] = True
        return keep_and_pool(layout, kept)

    @staticmethod
    def adaptive_keep(a: torch.Tensor) -> torch.Tensor:
        """``[n]`` bool: the outliers of ``a [n]`` and PruMerge+'s spatial samples."""
        n = a.numel()
        c = iqr_count(a)
        if c == 0:
            return torch.ones(n, dtype=torch.bool, device=a.device)
        keep = torch.zeros(n, dtype=torch.bool, device=a.device)
        keep[torch.topk(a.float(), c).indices] = True
        stride = int(int(1 / (c / n)) / 3)
        keep[torch.arange(0, n - 1, max(stride, 1), device=a.device)] = True
        return keep

    @staticmethod
    def fixed_keep(a: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``[n]`` bool: ``k - 1`` patches (the extra token takes the last slot): the top
        quarter by ``a``, the rest evenly spaced."""
        n, keep_n = a.numel(), int(k) - 1
        keep = torch.zeros(n, dtype=torch.bool, device=a.device)
        if int(k) >= n:
            return keep.fill_(True)
        top = int(round(keep_n / 4))
        order = torch.sort(-a.double(), stable=True).indices
        keep[order[:top]] = True
        others = torch.nonzero(~keep).flatten()
        need = keep_n - top
        if need > 0:
            step = max(1, others.numel() // need)
            keep[others[::step][:need]] = True
        return keep


@MessagePasser.register("weighted_sum")
@dataclass
class WeightedSum(MessagePasser):
    """PruMerge+'s extra token: the relevance-weighted *sum* of the tokens merged into a
    target and the target itself, ``w_b x_b + sum_a w_a x_a`` (not divided by the weights;
    the code's ``torch.sum(non_topk * non_topk_attn.unsqueeze(-1), dim=1)``)."""

    def weight(self, relevance, size):
        return relevance

    def update(self, x, w, agg, agg_w):
        return x.mul_(w.unsqueeze(-1)).add_(agg)
