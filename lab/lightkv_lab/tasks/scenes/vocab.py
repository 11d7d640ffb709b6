"""The Scenes-VQA vocabulary: the words, their ids, and the four labels of a token.

Special tokens come first, with DigitGrid's ids (one collation, one tokenizer layout).
`LABEL_GROUPS` lists the words each of a token's four labels takes (see
`lightkv_lab.tasks.scenes.scene.Scene.labels`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightkv_lab.tasks.digitgrid import data as _dg

__all__ = [
    "ASKED_REGION",
    "BOS_ID",
    "COLOURS",
    "CONTENT_IDS",
    "COUNT_WORDS",
    "DETAIL_QTYPES",
    "EOS_ID",
    "GLYPHS",
    "HORIZONTAL",
    "IMAGE_ID",
    "LABEL_GROUPS",
    "MATERIALS",
    "MAX_COUNT",
    "PAD_ID",
    "QTYPES",
    "SEP_ID",
    "SLOTS",
    "SPECIAL_TOKENS",
    "SPLITS",
    "TEMPLATE_WORDS",
    "TEXTURES",
    "VERTICAL",
    "VOCAB",
    "WORD_TO_ID",
    "decode",
    "encode",
]

SPLITS = ("train", "heldout")
QTYPES = ("texture", "where", "count", "exists", "read", "relation")
DETAIL_QTYPES = ("count", "exists", "read")
"""Question types whose answer hinges on single tokens."""
ASKED_REGION = True
"""Episodes carry ``meta["region"]``: the tokens the answer is read from (see `Episode`)."""

COLOURS = ("red", "yellow", "green", "cyan", "blue", "magenta")
TEXTURES = ("solid", "striped", "checked", "dotted")
MATERIALS = ("field", "sand", "water", "stone")
GLYPHS = ("alpha", "beta", "gamma", "delta", "eta", "theta", "kappa", "sigma")
SLOTS = ("s1", "s2", "s3")
VERTICAL = ("top", "bottom")
HORIZONTAL = ("left", "right")
MAX_COUNT = 3
COUNT_WORDS = tuple(f"n{i}" for i in range(MAX_COUNT + 1))

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<image>", "<sep>")
TEMPLATE_WORDS = (
    "what",
    "texture",
    "is",
    "the",
    "object",
    "where",
    "how",
    "many",
    "gems",
    "there",
    "a",
    "gem",
    "read",
    "sign",
    "yes",
    "no",
    "ground",
)
VOCAB: tuple[str, ...] = (
    SPECIAL_TOKENS
    + TEMPLATE_WORDS
    + COLOURS
    + TEXTURES
    + MATERIALS
    + GLYPHS
    + SLOTS
    + VERTICAL
    + HORIZONTAL
    + COUNT_WORDS
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


def _ids(words: Sequence[str]) -> tuple[int, ...]:
    return tuple(WORD_TO_ID[w] for w in words)


LABEL_GROUPS: tuple[tuple[int, ...], ...] = (
    _ids(COLOURS + GLYPHS + MATERIALS),  # what the token shows
    _ids(TEXTURES + ("gem",) + SLOTS + ("ground",)),  # what kind of thing it is part of
    _ids(VERTICAL),
    _ids(HORIZONTAL),
)
"""Word ids of each of a token's four labels (see `Scene.labels`)."""
CONTENT_IDS = LABEL_GROUPS[0]


def encode(words: Sequence[str]) -> list[int]:
    """Word list -> id list. Raises ``KeyError`` naming the first unknown word."""
    try:
        return [WORD_TO_ID[w] for w in words]
    except KeyError as e:
        raise KeyError(f"word {e.args[0]!r} is not in the Scenes vocabulary") from None


def decode(ids: Sequence[int] | torch.Tensor, *, skip_special: bool = False) -> list[str]:
    """Id list (or 1-D tensor) -> word list; ``skip_special`` drops ``<pad>``/``<bos>``/... ."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    words = [VOCAB[i] for i in ids]
    return [w for w in words if w not in SPECIAL_TOKENS] if skip_special else words
