"""The DigitGrid vocabulary and the constants the other DigitGrid modules share.

The word vocabulary (special tokens first, then template, answer, digit, cell and count
words; a word's id is its index), the special-token ids, `CONTENT_IDS`, `IGNORE_INDEX`,
`encode` / `decode`, and the task's fixed constants: the splits and their sklearn index
boundary, the question types, the glyph kinds and the largest grid and digit count. It
imports nothing else of the package, so every other DigitGrid module may import it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "ANSWER_WORDS",
    "BOS_ID",
    "CELL_WORDS",
    "CONTENT_IDS",
    "COUNT_WORDS",
    "DIGIT_WORDS",
    "EOS_ID",
    "GLYPHS",
    "IGNORE_INDEX",
    "IMAGE_ID",
    "MAX_COUNT",
    "MAX_GRID",
    "PAD_ID",
    "QTYPES",
    "SEP_ID",
    "SPECIAL_TOKENS",
    "SPLITS",
    "SPLIT_BOUNDARY",
    "TEMPLATE_WORDS",
    "VOCAB",
    "WORD_TO_ID",
    "decode",
    "encode",
]

SPLIT_BOUNDARY = 1400
"""sklearn digit indices ``< SPLIT_BOUNDARY`` are ``train``; the rest are ``heldout``."""

SPLITS = ("train", "heldout")
QTYPES = ("what", "where", "count", "exists")

GLYPHS = ("handwritten", "font", "colour")

MAX_GRID = 8
"""Largest supported grid side (the vocabulary holds cell words up to this)."""
MAX_COUNT = 16
"""Largest supported number of digits per image (the vocabulary holds ``n0``..``n16``)."""

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<image>", "<sep>")
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CELL_WORDS = tuple(f"r{r}c{c}" for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1))
"""``r{row}c{column}`` (1-based): one word names one cell, row-major."""
COUNT_WORDS = tuple(f"n{i}" for i in range(MAX_COUNT + 1))
TEMPLATE_WORDS = (
    "what",
    "is",
    "at",
    "where",
    "the",
    "digit",
    "how",
    "many",
    "digits",
    "there",
    "a",
)
ANSWER_WORDS = ("none", "yes", "no")

VOCAB: tuple[str, ...] = (
    SPECIAL_TOKENS + TEMPLATE_WORDS + ANSWER_WORDS + DIGIT_WORDS + CELL_WORDS + COUNT_WORDS
)
"""The fixed word vocabulary; a word's id is its index. Special tokens come first."""
WORD_TO_ID: dict[str, int] = {w: i for i, w in enumerate(VOCAB)}
assert len(WORD_TO_ID) == len(VOCAB), "duplicate word in VOCAB"

PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, SEP_ID = (WORD_TO_ID[t] for t in SPECIAL_TOKENS)
CONTENT_IDS = tuple(WORD_TO_ID[w] for w in (*DIGIT_WORDS, "none"))
"""Word ids of a cell's possible contents: the ten digit names, then ``none`` (class 10)."""
IGNORE_INDEX = -100


def encode(words: Sequence[str]) -> list[int]:
    """Word list -> id list. Raises ``KeyError`` naming the first unknown word."""
    try:
        return [WORD_TO_ID[w] for w in words]
    except KeyError as e:
        raise KeyError(f"word {e.args[0]!r} is not in the DigitGrid vocabulary") from None


def decode(ids: Sequence[int] | torch.Tensor, *, skip_special: bool = False) -> list[str]:
    """Id list (or 1-D tensor) -> word list; ``skip_special`` drops ``<pad>``/``<bos>``/... ."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    words = [VOCAB[i] for i in ids]
    if skip_special:
        words = [w for w in words if w not in SPECIAL_TOKENS]
    return words
