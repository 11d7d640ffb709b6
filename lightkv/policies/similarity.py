"""`QuestionSimilarity`: relevance as the cosine of each vision token to the question's tokens.

The relevance a pre-LLM stage can afford at 7B width. `QuestionAttention` before the first
decoder layer projects layer 0's queries and keys of every token a second time (two
``N x D x D`` products, 2% of a 7B prefill at 3,000 tokens); this reads the hidden states
the stage already holds (before the LLM: the input embeddings, where projected image tokens
and text token embeddings share one space) and costs ``N x T x D`` for ``T`` question
tokens. It is CDPruner's instruction relevance (Zhang et al., NeurIPS 2025,
arXiv:2506.10967, Eq. 6; their ``llava_arch.py`` lines 155-160 at 9541616), without the
negation their CLIP space needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..graph.scatter import pack_rows
from .relevance import Relevance, _accumulator

__all__ = ["QuestionSimilarity"]


@Relevance.register("question_similarity")
@dataclass
class QuestionSimilarity(Relevance):
    """Mean cosine similarity of each vision token to the question's tokens, min-max scaled
    per row.

    For row ``b``, vision token ``i`` with hidden state ``x_i`` and question tokens ``t_m``
    (`Prompt.question_mask`: the text after the row's last vision token):

        r_i = mean_m cos(x_i, t_m),   ξ_i = (r_i - min r + floor) / (max r - min r + floor)

    (min and max over the row's vision tokens), so ξ lies in ``(0, 1]``: the most similar
    token 1, the least ``floor / (range + floor)``, never 0, so a weighted merge
    (``relevance_mean``) still counts every token. A row without question tokens, or whose
    ``r`` is constant, gets ξ = 1 on every vision token (uniform: a coverage pruner then
    picks by coverage alone). Zero outside vision tokens.

    The same as CDPruner's relevance: the mean over the instruction's tokens of the cosine
    in the LLM's input space and the per-row min-max scaling. Differs: no negation (theirs
    is specific to CLIP as LLaVA uses it, github.com/Theia-4869/CDPruner/issues/14), a
    floor of 1e-3 of the range instead of their 1e-6 added to the numerator only.

    Attributes:
        floor: what the least similar token keeps, as a share of the row's range (> 0).
    """

    query_rows: ClassVar[str] = "none"
    key_cols: ClassVar[str] = "none"
    reads_prompt: ClassVar[bool] = True
    reads_hidden: ClassVar[bool] = True
    floor: float = 1e-3

    def __post_init__(self) -> None:
        if (
            isinstance(self.floor, bool)
            or not isinstance(self.floor, (int, float))
            or not 0 < self.floor < float("inf")
        ):
            raise ValueError(
                f"question_similarity: floor must be a finite number > 0, got {self.floor!r}"
            )

    def score(self, queries, keys, layout, prompt=None, hidden=None):
        """``hidden [B, N, D]`` (the states the stage reads), ``prompt`` -> ``[B, N]``
        (``queries`` and ``keys`` are not read)."""
        if hidden is None or prompt is None:
            raise ValueError(
                "question_similarity needs the hidden states and the prompt's token ids: adapters "
                "pass both; in a direct call pass hidden=[B, N, D] and prompt=Prompt(input_ids)"
            )
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (layout.batch_size, layout.seq_len):
            raise ValueError(
                f"hidden {tuple(hidden.shape)} does not match the layout "
                f"[B={layout.batch_size}, N={layout.seq_len}, D]"
            )
        vision = layout.vision_mask
        question = prompt.question_mask(layout)
        x = torch.nn.functional.normalize(hidden.to(_accumulator(hidden)), dim=-1)
        # the question's tokens packed per row, [B, T, D]: a row's T x N products, never N x N
        pos, valid = pack_rows(question)
        t = x.gather(1, pos.unsqueeze(-1).expand(-1, -1, x.shape[-1])) * valid.unsqueeze(-1)
        count = valid.sum(1, keepdim=True)  # [B, 1]
        r = torch.einsum("bnd,btd->bn", x, t) / count.clamp_min(1)
        big = torch.finfo(r.dtype).max
        lo = torch.where(vision, r, big).amin(1, keepdim=True)
        hi = torch.where(vision, r, -big).amax(1, keepdim=True)
        span = hi - lo
        eps = torch.finfo(r.dtype).eps
        flat = (count == 0) | (span <= eps * hi.abs().clamp_min(1.0)) | ~vision.any(1, keepdim=True)
        floor = self.floor * span
        xi = (r - lo + floor) / (span + floor).clamp_min(torch.finfo(r.dtype).tiny)
        xi = torch.where(flat, torch.ones_like(xi), xi.clamp(0.0, 1.0))
        return torch.where(vision, xi, torch.zeros_like(xi))

    def hidden_flops(self, layout, hidden_size, prompt=None):
        """``2 N T D`` per row: every token's cosine to the row's ``T`` question tokens."""
        t = (
            int(prompt.question_mask(layout).sum(1).max())
            if prompt is not None and layout.batch_size
            else 0
        )
        return 2.0 * layout.batch_size * layout.seq_len * t * hidden_size
