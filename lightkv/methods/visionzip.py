"""VisionZip's split (Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision
Language Models", CVPR 2025, arXiv:2412.04467): dominant tokens kept whole, contextual
tokens merged.

Each image keeps ``k`` tokens: the ``d`` tokens with the highest relevance (VisionZip: the
CLS attention in the vision tower, `lightkv.methods.visionzip.TowerAttention`) stay as they are;
of the rest, ``c = k - d`` evenly spaced targets receive every other remaining token, each
merged into its most similar target. As a partition: dominant tokens are outside the
graph, targets are side B, every other remaining token is side A, and an image is one
window; with the ``all_sources`` pruner, a ``cosine`` scorer and the ``target_plus_mean``
passer (`TargetPlusMean`) a stage is VisionZip's contextual merging (each target becomes
itself plus the mean of the tokens assigned to it, as the authors' code computes it).

`TowerAttention`: relevance read inside the vision tower, before the language model sees the
image.

VisionZip (Yang et al., CVPR 2025, arXiv:2412.04467) and VisPruner (Zhang et al., ICCV
2025, arXiv:2412.01818) rank an image's tokens by the attention they receive in the vision
encoder: from the CLS token in CLIP, or averaged over every query where the encoder has no
CLS (SigLIP). That attention is prompt-agnostic; it marks the tokens the encoder itself
gathers information into. An adapter computes it from the tower's own projections at the
layer whose output the projector reads (no ``N x N`` matrix is stored: the CLS row is one
query; the mean over queries is accumulated in chunks) and hands it to a policy that
declares ``reads_tower``:

```python
import torch
from lightkv import ImageSegment, VisionLayout
from lightkv.methods.visionzip import TowerAttention
layout = VisionLayout.from_segments(1, 6, [ImageSegment(row=0, offset=1, grid=(2, 2))])
tower = torch.zeros(1, 2, 6)                       # [B, H, N]: attention received per head
tower[0, :, 1:5] = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.2, 0.2, 0.5, 0.1]])
TowerAttention().score(None, None, layout, tower=tower)   # summed over heads
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..graph.scatter import segment_rank
from ..policies.counts import image_vision_counts, kept_count
from ..policies.partitioners import Partition, Partitioner
from ..policies.passers import MessagePasser
from ..policies.relevance import Heads, Relevance, _check_heads, _reduce_heads

__all__ = ["DominantContextual", "TargetPlusMean", "TowerAttention"]


@Partitioner.register("dominant_context")
@dataclass
class DominantContextual(Partitioner):
    """VisionZip's dominant / contextual split of each image.

    With ``n`` current vision tokens in an image and the stage's removal ratio ``P``, the
    image's budget is ``k = n - floor(P n)`` slots (`lightkv.policies.counts.kept_count`), of
    which ``c = max(1, round(contextual * k))`` are contextual and ``d = k - c`` dominant;
    nothing happens to an image with ``k = n``. Following VisionZip's ``visionzip/clip_encoder.py``
    (``CLIPVisionTower_VisionZip.forward``, github.com/dvlab-research/VisionZip at 3151f6d):

    * the CLS slot: ``visionzip(model, dominant=54, contextual=10)`` keeps 64 tokens, the CLS
      token and 53 patches among the 54 dominant ones (``visionzip/main.py`` sets
      ``dominant_num = dominant - 1``; the CLS index is prepended to the top-k). With
      ``cls_slot`` (default) one dominant slot is the CLS token's, so ``d - 1`` patches are
      dominant; LLaVA's default feature selection drops the CLS token before the language
      model, so that slot stays empty and the image keeps ``k - 1`` tokens. The contextual
      targets are placed among the ``n - d + 1`` other patches, as in the code.
      ``cls_slot = False`` spends all ``d`` slots on patches (lightkv's former variant:
      ``k`` tokens kept);
    * dominant: the top patches by relevance ξ (``cls_attention_sum.topk``); ties go to the
      earlier token;
    * targets: of the ``R`` remaining patches in sequence order, those at
      ``0, step, 2 step, ...`` with ``step = max(1, R // c)``, the first ``c`` of them
      (``torch.arange(0, R, step)[:c]``);
    * the other remaining tokens are sources, merged into the target of highest
      similarity (the stage's scorer; VisionZip uses the tower layer's keys averaged over
      heads, a stage here the features its scorer reads) by the stage's passer (the
      code's ``target + mean(assigned)``: `TargetPlusMean`).

    VisionZip's released budgets are 54 + 10, 108 + 20 and 162 + 30 of 576 tokens, a
    contextual share of 10/64 at each.

    Attributes:
        contextual: share of the kept slots that are contextual (merged) tokens.
        cls_slot: one dominant slot is the (absent) CLS token's, as in the authors' code.
    """

    contextual: float = 10 / 64
    cls_slot: bool = True

    def __post_init__(self) -> None:
        if (
            isinstance(self.contextual, bool)
            or not isinstance(self.contextual, (int, float))
            or not (0.0 < float(self.contextual) <= 1.0)
        ):
            raise ValueError(f"contextual must be a share in (0, 1], got {self.contextual!r}")
        if not isinstance(self.cls_slot, bool):
            raise ValueError(f"cls_slot must be true or false, got {self.cls_slot!r}")

    def partition(self, inputs):
        layout = inputs.layout
        vision = layout.vision_mask
        if not bool(vision.any()):
            return Partition.empty(layout)
        window, is_src = Partition.empty(layout).window, torch.zeros_like(vision)
        if inputs.relevance is None:
            raise ValueError(
                "the dominant_context partitioner ranks tokens by relevance: give the stage a "
                "relevance (VisionZip: tower_attention)"
            )
        n = image_vision_counts(layout)
        k = kept_count(n, inputs.spec.removal_ratio)
        c = torch.where(k < n, torch.round(k.double() * float(self.contextual)).long().clamp(1), 0)
        c = torch.minimum(c, k)
        d = k - c
        if self.cls_slot:  # the CLS token takes one dominant slot; it is not in this sequence
            d = torch.where(k < n, (d - 1).clamp_min(0), d)
        img = layout.image[vision]  # [M] in sequence order
        xi = inputs.relevance[vision].to(torch.float64)
        # rank by relevance inside each image: descending xi, ties to the earlier token
        by_xi = torch.sort(-xi, stable=True).indices
        order = by_xi[torch.sort(img[by_xi], stable=True).indices]
        rank = torch.empty_like(img)
        rank[order] = segment_rank(img[order])
        dominant = rank < d[img]
        rest = ~dominant & (k[img] < n[img])
        rest_img = img[rest]
        rest_rank = segment_rank(rest_img)
        step = torch.clamp_min(torch.div(n - d, c.clamp_min(1), rounding_mode="floor"), 1)[rest_img]
        target = (rest_rank % step == 0) & (
            torch.div(rest_rank, step, rounding_mode="floor") < c[rest_img]
        )
        win = torch.full_like(img, -1)
        win[rest] = rest_img
        src = torch.zeros_like(rest)
        src[rest] = ~target
        window[vision] = win
        is_src[vision] = src
        used = torch.unique(window[window >= 0], sorted=True, return_inverse=True)[1]  # compact ids
        window[window >= 0] = used
        return Partition(window, is_src)


@MessagePasser.register("target_plus_mean")
@dataclass
class TargetPlusMean(MessagePasser):
    """VisionZip's contextual token: the target plus the mean of the tokens merged into it,
    ``x_b + sum_a s_a x_a / sum_a s_a`` (``s``: the tokens' sizes, 1 before any merge), not the
    mean of both (``contextual_tokens = target_hidden + aggregated_hidden`` in the authors'
    ``visionzip/clip_encoder.py``). A target with nothing merged into it stays as it is."""

    def weight(self, relevance, size):
        return size.to(torch.float64)

    def update(self, x, w, agg, agg_w):
        return x.add_(agg.div_(agg_w.unsqueeze(-1)))


@Relevance.register("tower_attention")
@dataclass
class TowerAttention(Relevance):
    """Attention each vision token receives inside the vision tower, reduced over heads.

    VisionZip's dominant-token score: the CLS row of the attention at the tower layer
    whose hidden states the projector reads (``vision_feature_layer``, -2 in LLaVA-1.5),
    summed over heads (``cls_attention = attn[:, :, 0, 1:].sum(dim=1)`` in VisionZip's
    ``visionzip/clip_encoder.py``, ``CLIPVisionTower_VisionZip.forward``). Where the tower
    has no CLS token, adapters give the attention received averaged over all queries.
    It does not depend on the prompt; no LLM layer is projected for it.

    Attributes:
        heads: ``sum`` (VisionZip), ``mean`` or ``max`` over the tower's heads.
        queries: which query rows the adapter reads: ``cls`` (the CLS token's row; a tower
            without CLS is refused), ``mean`` (the attention received averaged over every
            query, SigLIP-style) or ``auto`` (``cls`` where the tower has one, else
            ``mean``: the methods' own rule).
    """

    query_rows = "none"
    key_cols = "none"
    reads_tower: ClassVar[bool] = True
    heads: Heads = "sum"
    queries: Literal["auto", "cls", "mean"] = "auto"

    def __post_init__(self) -> None:
        _check_heads(self.heads)
        if self.queries not in ("auto", "cls", "mean"):
            raise ValueError(f"unknown queries {self.queries!r}; choose auto, cls or mean")

    def score(self, queries, keys, layout, tower=None):
        """``tower [B, H, N]`` (attention received per head, any value off vision tokens) ->
        ``[B, N]``."""
        if tower is None:
            raise ValueError(
                "tower_attention reads the vision tower's attention: inside a model the adapter "
                "passes it (LLaVA-family towers); in a direct call pass tower=[B, H, N]"
            )
        if tower.dim() != 3 or tuple(tower.shape[::2]) != (layout.batch_size, layout.seq_len):
            raise ValueError(
                "tower attention must be [B, H, N] with B, N = "
                f"{(layout.batch_size, layout.seq_len)}, got {tuple(tower.shape)}"
            )
        xi = _reduce_heads(tower.to(torch.promote_types(tower.dtype, torch.float32)), self.heads)
        return torch.where(layout.vision_mask, xi.clamp_min(0), torch.zeros_like(xi))
