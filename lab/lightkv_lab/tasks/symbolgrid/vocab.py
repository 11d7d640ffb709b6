"""The SymbolGrid vocabulary and the constants the other SymbolGrid modules share.

The splits and question types, the 32 symbols (8 colours x 4 shapes), the word vocabulary
(special tokens first, with DigitGrid's ids, then template, answer, symbol, cell and count
words; a word's id is its index), `encode` / `decode` and the words naming a symbol or a cell.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightkv_lab.tasks.digitgrid import data as _dg

__all__ = [
    "ANSWER_WORDS",
    "BOS_ID",
    "CELL_WORDS",
    "COLOURS",
    "CONTENT_IDS",
    "COUNT_WORDS",
    "DETAIL_QTYPES",
    "EOS_ID",
    "IMAGE_ID",
    "MAX_COUNT",
    "MAX_GRID",
    "PAD_ID",
    "QTYPES",
    "SEP_ID",
    "SHAPES",
    "SPECIAL_TOKENS",
    "SPLITS",
    "SYMBOL_WORDS",
    "TEMPLATE_WORDS",
    "VOCAB",
    "WORD_TO_ID",
    "cell_word",
    "decode",
    "encode",
    "symbol_word",
]

SPLITS = ("train", "heldout")
QTYPES = ("what", "read", "count", "exists")
DETAIL_QTYPES = ("what", "read")
"""Question types whose answer is the content of single tokens."""

MAX_GRID = 24
"""Largest supported grid side (the vocabulary holds cell words up to this)."""
MAX_COUNT = 8

COLOURS = ("red", "gold", "lime", "green", "cyan", "azure", "violet", "magenta")
SHAPES = ("bar", "post", "dot", "ring")
SYMBOL_WORDS = tuple(f"{c}-{s}" for c in COLOURS for s in SHAPES)
"""The 32 symbols, colour-major: symbol ``k`` is colour ``k // 4``, shape ``k % 4``."""

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<image>", "<sep>")
CELL_WORDS = tuple(f"r{r}c{c}" for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1))
COUNT_WORDS = tuple(f"n{i}" for i in range(MAX_COUNT + 1))
TEMPLATE_WORDS = ("what", "is", "at", "read", "how", "many", "there", "a")
ANSWER_WORDS = ("yes", "no")

VOCAB: tuple[str, ...] = (
    SPECIAL_TOKENS + TEMPLATE_WORDS + ANSWER_WORDS + SYMBOL_WORDS + CELL_WORDS + COUNT_WORDS
)
"""The fixed word vocabulary; a word's id is its index. Special tokens come first (the
same ids as DigitGrid's)."""
WORD_TO_ID: dict[str, int] = {w: i for i, w in enumerate(VOCAB)}
assert len(WORD_TO_ID) == len(VOCAB), "duplicate word in VOCAB"

PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, SEP_ID = (WORD_TO_ID[t] for t in SPECIAL_TOKENS)
assert (PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, SEP_ID) == (
    _dg.PAD_ID,
    _dg.BOS_ID,
    _dg.EOS_ID,
    _dg.IMAGE_ID,
    _dg.SEP_ID,
), "SymbolGrid shares DigitGrid's special-token ids (one collation, one tokenizer layout)"
CONTENT_IDS = tuple(WORD_TO_ID[w] for w in SYMBOL_WORDS)


def encode(words: Sequence[str]) -> list[int]:
    """Word list -> id list. Raises ``KeyError`` naming the first unknown word."""
    try:
        return [WORD_TO_ID[w] for w in words]
    except KeyError as e:
        raise KeyError(f"word {e.args[0]!r} is not in the SymbolGrid vocabulary") from None


def decode(ids: Sequence[int] | torch.Tensor, *, skip_special: bool = False) -> list[str]:
    """Id list (or 1-D tensor) -> word list; ``skip_special`` drops ``<pad>``/``<bos>``/... ."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    words = [VOCAB[i] for i in ids]
    return [w for w in words if w not in SPECIAL_TOKENS] if skip_special else words


def symbol_word(k: int) -> str:
    return SYMBOL_WORDS[k]


def cell_word(row: int, col: int) -> str:
    """The word naming cell ``(row, col)`` (0-based), e.g. ``cell_word(4, 6) == "r5c7"``."""
    if not (0 <= row < MAX_GRID and 0 <= col < MAX_GRID):
        raise ValueError(f"cell ({row}, {col}) is outside a {MAX_GRID}x{MAX_GRID} grid")
    return CELL_WORDS[row * MAX_GRID + col]
