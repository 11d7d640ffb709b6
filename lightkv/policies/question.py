"""`QuestionAttention`: relevance from the question's own attention, read off the prompt.

The policy that a prompt-aware relevance is in one file: it declares ``reads_prompt`` and
receives the prefill's `Prompt` beside the layer's queries and keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .relevance import Heads, Relevance, _check_heads, attention_from_rows

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

    query_rows = "all"
    key_cols = "all"
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
            raise ValueError(
                "question_attention needs the prompt's token ids: the adapter passes them from "
                "input_ids; in a direct call pass prompt=Prompt(input_ids)"
            )
        question = prompt.question_mask(layout)
        chosen = question
        if self.ids is not None:
            chosen = chosen & prompt.match(layout, self.ids)
        if self.exclude:
            chosen = chosen & ~prompt.match(layout, self.exclude)
        rows = torch.where(~chosen.any(1, keepdim=True), question, chosen)  # [B, N] the rows read
        return attention_from_rows(queries, keys, layout, rows, self.heads, causal=True)
