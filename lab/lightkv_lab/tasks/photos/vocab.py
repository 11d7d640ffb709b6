"""The Photos-VQA vocabulary and question mix.

Special tokens come first, with DigitGrid's ids (one collation, one tokenizer layout).
`MIX` is the share of each question type in evaluation, modelled on the eight benchmarks of
TOPS's Table 11 (see `lightkv_lab.tasks.photos.data` for the reasoning).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightkv_lab.tasks.digitgrid import data as _dg

__all__ = [
    "BOS_ID",
    "COARSE_QTYPES",
    "COLOURS",
    "CONTENT_IDS",
    "COUNT_WORDS",
    "EOS_ID",
    "FINE_QTYPES",
    "IMAGE_ID",
    "KINDS",
    "LETTERS",
    "MAX_COUNT",
    "MIX",
    "PAD_ID",
    "QTYPES",
    "RELATIONS",
    "SCENES",
    "SEP_ID",
    "SPECIAL_TOKENS",
    "SPLITS",
    "VOCAB",
    "WORD_TO_ID",
    "decode",
    "encode",
]

SPLITS = ("train", "heldout")
COARSE_QTYPES = ("exists", "scene", "colour", "kind", "relation")
FINE_QTYPES = ("read", "count", "small")
QTYPES = COARSE_QTYPES + FINE_QTYPES
MIX: dict[str, float] = {
    "exists": 0.20,
    "scene": 0.10,
    "colour": 0.10,
    "kind": 0.10,
    "relation": 0.15,
    "read": 0.15,
    "count": 0.10,
    "small": 0.10,
}
"""Evaluation shares: coarse 65%, fine 35% (see `lightkv_lab.tasks.photos.data`)."""

COLOURS = ("red", "yellow", "green", "blue", "purple", "white")
KINDS = ("ball", "box", "star", "ring", "cone", "cross")
SCENES = (
    "astronaut",
    "wall",
    "camera",
    "cat",
    "coffee",
    "grass",
    "gravel",
    "sky",
    "tissue",
    "retina",
    "rocket",
    "temple",
    "flower",
    "portrait",
    "clock",
    "coins",
)
"""Background categories: one per bundled photograph (`lightkv_lab.tasks.photos.images`)."""
LETTERS = ("A", "C", "E", "H", "K", "M", "P", "R", "T", "X")
"""Sign letters (capitals whose shapes differ)."""
RELATIONS = ("left", "right", "above", "below")
MAX_COUNT = 4
COUNT_WORDS = ("zero", "one", "two", "three", "four")

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<image>", "<sep>")
TEMPLATE_WORDS = (
    "is",
    "there",
    "a",
    "what",
    "the",
    "background",
    "colour",
    "object",
    "big",
    "small",
    "where",
    "from",
    "does",
    "sign",
    "say",
    "how",
    "many",
    "dots",
    "yes",
    "no",
)
VOCAB: tuple[str, ...] = (
    SPECIAL_TOKENS + TEMPLATE_WORDS + COLOURS + KINDS + SCENES + LETTERS + RELATIONS + COUNT_WORDS
)
"""The fixed word vocabulary; a word's id is its index (special tokens first, DigitGrid's ids)."""
WORD_TO_ID: dict[str, int] = {w: i for i, w in enumerate(VOCAB)}
assert len(WORD_TO_ID) == len(VOCAB), "duplicate word in VOCAB"
PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, SEP_ID = (WORD_TO_ID[t] for t in SPECIAL_TOKENS)
assert (PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, SEP_ID) == (
    _dg.PAD_ID,
    _dg.BOS_ID,
    _dg.EOS_ID,
    _dg.IMAGE_ID,
    _dg.SEP_ID,
)
CONTENT_IDS = tuple(WORD_TO_ID[w] for w in COLOURS + KINDS)
"""Word ids of what an object token shows (the registry's content classes)."""


def encode(words: Sequence[str]) -> list[int]:
    """Word list -> id list. Raises ``KeyError`` naming the first unknown word."""
    try:
        return [WORD_TO_ID[w] for w in words]
    except KeyError as e:
        raise KeyError(f"word {e.args[0]!r} is not in the Photos vocabulary") from None


def decode(ids: Sequence[int] | torch.Tensor, *, skip_special: bool = False) -> list[str]:
    """Id list (or 1-D tensor) -> word list; ``skip_special`` drops ``<pad>``/``<bos>``/... ."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    words = [VOCAB[i] for i in ids]
    return [w for w in words if w not in SPECIAL_TOKENS] if skip_special else words
