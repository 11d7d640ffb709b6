"""TRIM: keep the image tokens whose similarity to the question is an outlier (IQR) and pool
the rest into one aggregated token.

Song, Wang, Chen, Wang, Guan, Wang, "Less is More: A Simple yet Effective Token Reduction
Method for Efficient Multi-modal LLMs", COLING 2025 (arXiv:2409.10994); code
github.com/FreedomIntelligence/TRIM (``llava/model/multimodal_encoder/clip_encoder.py``,
``CLIPVisionTower.token_reduction``, read at f5a232d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..policies.counts import image_vision_counts, kept_count
from ..policies.partitioners import Partition, Partitioner
from .prumerge import adaptive, iqr_count, keep_and_pool

__all__ = ["TRIMSplit", "trim_scores"]


def trim_scores(image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """``[n]`` TRIM's score of an image's tokens ``image [n, D]`` against one text vector
    ``text [D]``: the softmax over the image of the *negated* dot products (the code's
    ``similarities = -similarities; softmax``), in float32 as the code computes it."""
    s = image.to(torch.float32) @ text.to(torch.float32)
    return torch.softmax(-s, dim=-1)


@Partitioner.register("trim")
@dataclass
class TRIMSplit(Partitioner):
    """TRIM's kept set per image, and one aggregated token of the rest.

    The authors' rule (``token_reduction``, lines 72-132 at f5a232d), with ``k = -1`` (the
    count by outliers): ``s = softmax(-(x_i . t))`` over the image's tokens, ``x_i`` the
    CLIP image embeddings of the patches (the tower's features, post-layernormed and
    projected by CLIP's visual projection) and ``t`` CLIP's text embedding of the question,
    neither normalised; ``c`` = the number of ``s_i > Q3 + 1.5 IQR``; the ``c`` largest ``s``
    are kept (``torch.topk``) in sequence order, and every other token is pooled into one
    token, their mean (the passer ``size_mean`` does that here), placed after them.

    The substitute. A stock transformers LVLM has no CLIP text encoder, and its image
    tokens are the projector's outputs: here ``x_i`` is the image token's input embedding
    and ``t`` the mean of the question tokens' input embeddings (the text after the row's
    last vision token, `lightkv.policies.Prompt.question_mask`), as `cdpruner` does. A
    stage without a prompt, or a row without question tokens, is refused: TRIM has no
    prompt-free rule.

    Under the kept-fraction knob (the stage's spec not adaptive) an image keeps exactly
    ``k = n - floor(P n)``: the ``k - 1`` largest ``s`` and the aggregated token (the code's
    ``TRIM:<fraction>`` mode keeps ``int(n * fraction)`` and the aggregate).
    """

    reads_prompt: ClassVar[bool] = True

    def partition(self, inputs):
        layout = inputs.layout
        vision = layout.vision_mask
        if not bool(vision.any()):
            return Partition.empty(layout)
        if inputs.prompt is None or inputs.hidden is None:
            raise ValueError(
                "trim ranks image tokens by their similarity to the question: the stage needs "
                "the prompt (Prompt(input_ids)) and the hidden states"
            )
        question = inputs.prompt.question_mask(layout).to(inputs.hidden.device)
        count = question.sum(1)
        rows = torch.unique(torch.nonzero(vision)[:, 0])
        if bool((count[rows] == 0).any()):
            raise ValueError(
                "trim needs question tokens after the image in every row with an image: a "
                "prompt that ends with its image has nothing to rank the tokens against"
            )
        h = inputs.hidden
        text = (h * question.unsqueeze(-1)).sum(1) / count.clamp_min(1).unsqueeze(-1).to(h.dtype)
        img = layout.image[vision]
        row_of = torch.nonzero(vision)[:, 0]
        x = h[vision]
        budget = kept_count(image_vision_counts(layout), inputs.spec.removal_ratio)
        kept = torch.zeros_like(img, dtype=torch.bool)
        for i in range(layout.num_images):
            where = torch.nonzero(img == i).flatten()
            if where.numel() == 0:
                continue
            s = trim_scores(x[where], text[row_of[where[0]]])
            if adaptive(inputs):
                c = iqr_count(s)
            else:
                c = int(budget[i]) - 1 if int(budget[i]) < where.numel() else where.numel()
            if c > 0:
                kept[where[torch.topk(s, c).indices]] = True
        return keep_and_pool(layout, kept)
