"""`QuestionAttention`: relevance from the question's own attention, read off the prompt.

The policy that a prompt-aware relevance is in one file: it declares ``reads_prompt`` and
receives the prefill's `Prompt` beside the layer's queries and keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..graph.scatter import pack_rows
from .relevance import Heads, Relevance, _accumulator, _check_heads, _match_heads, _reduce_heads

__all__ = ["QuestionAttention"]


@Relevance.register("question_attention")
@dataclass
class QuestionAttention(Relevance):
    """Attention that the question's tokens pay each vision token (softmax over keys, causal),
    summed over the chosen question tokens, then reduced over heads.

    The question is the text after each row's last vision token (`Prompt.question_mask`),
    narrowed to the tokens whose ids are in ``ids`` when given (e.g. the content words a
    task's questions name: colours, objects) and without those in ``exclude`` (template
    words). Where ``text_attention`` sums every text row, this reads only the rows that
    say what is asked, so a chat template's system prompt or a separator does not dilute
    it. A row with no chosen token falls back to its whole question.

    Args:
        ids: token ids to read (None: every question token).
        exclude: token ids never read.
        heads: ``mean``, ``sum`` or ``max`` over query heads.
    """

    query_rows: ClassVar[str] = "all"
    key_cols: ClassVar[str] = "all"
    reads_prompt: ClassVar[bool] = True
    ids: tuple[int, ...] | None = None
    exclude: tuple[int, ...] = ()
    heads: Heads = "mean"

    def __post_init__(self) -> None:
        _check_heads(self.heads)
        if self.ids is not None:
            self.ids = tuple(int(i) for i in self.ids)
        self.exclude = tuple(int(i) for i in self.exclude)

    def score(self, queries, keys, layout, prompt=None):
        """``queries [B, H, N, d]``, ``keys [B, H_kv, N, d]``, ``prompt`` -> ``[B, N]``."""
        self._check(queries, keys, layout)
        if prompt is None:
            raise ValueError("question_attention needs the prompt's token ids: the adapter passes them from "
                             "input_ids; in a direct call pass prompt=Prompt(input_ids)")
        question = prompt.question_mask(layout)
        chosen = question
        if self.ids is not None:
            chosen = chosen & prompt.match(layout, self.ids)
        if self.exclude:
            chosen = chosen & ~prompt.match(layout, self.exclude)
        empty = ~chosen.any(1, keepdim=True)
        rows = torch.where(empty, question, chosen)  # [B, N] the query rows read
        pos, valid = pack_rows(rows)  # [B, T]
        h, d = queries.shape[1], queries.shape[-1]
        q = queries.gather(2, pos[:, None, :, None].expand(-1, h, -1, d))  # [B, H, T, d]
        k = _match_heads(keys, h)
        acc = _accumulator(queries)
        logits = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) / math.sqrt(d)  # [B, H, T, N]
        origin = layout.origin
        allowed = (layout.valid_mask[:, None, :] & valid[:, :, None]
                   & (origin[:, None, :] <= origin.gather(1, pos)[:, :, None]))  # causal, [B, T, N]
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        attn = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # padded slots give 0
        xi = _reduce_heads(attn.sum(dim=2), self.heads)
        return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))
