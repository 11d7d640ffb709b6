"""DigitGrid-VQA: synthetic visual question answering whose answers depend on one image region.

An image is a ``G x G`` grid of square cells on a seeded noisy background. Between
``min_digits`` and ``max_digits`` cells each hold a digit glyph (`GridConfig.glyphs`):
a handwritten digit from ``sklearn.datasets.load_digits`` (8x8, values 0-16), a digit of a
small bitmap font, or that font digit on a tile in the class's own colour; glyphs are
upscaled by nearest neighbour and placed in their cell. Questions are word-level templates:

=========  ==============================  ==============
qtype      question                        answer
=========  ==============================  ==============
what       what is at r2c3                 three | none
where      where is the digit three        r2c3
count      how many digits                 n5
exists     is there a three                yes | no
=========  ==============================  ==============

Digit names (``zero``..``nine``), cell words (``r1c1``.., row then column, 1-based) and
count words (``n0``..) are separate vocabularies so that no word is shared between roles.
``where`` is only asked for digits that occur exactly once; ``exists`` is yes/no 50/50 and
``what`` asks an occupied cell with probability ``what_occupied_p``.

The ``"train"`` split draws handwritten digits only from sklearn indices ``< 1400``, the
``"heldout"`` split only from indices ``>= 1400``; ``Episode.digit_index`` records the index
used in each cell. (Font and colour glyphs share their shapes between splits; held-out
episodes then differ by layout, strokes and noise only.)

Sequences (see `collate`) are ``<bos> <image>*n <sep> question [answer <eos>]``: the answer
follows the question's last word, which names what is asked (a cell, a digit). Rows are
left-padded, with ``labels`` equal to ``input_ids`` on the answer and ``<eos>`` and -100
elsewhere (the model shifts labels itself, as ``LlavaForConditionalGeneration`` does).

This module holds the episodes and their questions (`make_episode`, `make_scene`,
`EpisodeStream`, `answer_for`, `cell_word`); the rest lives below it and is re-exported
here: the vocabulary and constants in `lightkv_lab.tasks.digitgrid.vocab`, `GridConfig` and
`Episode` in `lightkv_lab.tasks.digitgrid.config`, the glyphs and images in
`lightkv_lab.tasks.digitgrid.images`, the batching in `lightkv_lab.tasks.batching`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

# the task's data interface (`lightkv_lab.tasks.registry.Task.data`): its vocabulary, configs,
# images and batching, read by the shared trainer, evaluation and scoring as ``task.data.X``
from lightkv_lab.tasks.batching import (
    collate,
    collate_prompts,
    collate_scenes,
    left_pad,
    num_image_tokens,
)
from lightkv_lab.tasks.digitgrid.config import DEFAULT_CONFIG, Episode, GridConfig
from lightkv_lab.tasks.digitgrid.images import (
    digit_pool,
    make_grid,
    render_image,
    sample_image,
    to_pil,
)
from lightkv_lab.tasks.digitgrid.vocab import (
    BOS_ID,
    CELL_WORDS,
    CONTENT_IDS,
    COUNT_WORDS,
    DIGIT_WORDS,
    EOS_ID,
    GLYPHS,
    IGNORE_INDEX,
    IMAGE_ID,
    MAX_GRID,
    PAD_ID,
    QTYPES,
    SEP_ID,
    SPECIAL_TOKENS,
    SPLIT_BOUNDARY,
    SPLITS,
    VOCAB,
    WORD_TO_ID,
    decode,
    encode,
)
from lightkv_lab.tasks.stream import EpisodeStream as _Stream

__all__ = [
    "BOS_ID",
    "CELL_WORDS",
    "CONTENT_IDS",
    "COUNT_WORDS",
    "DIGIT_WORDS",
    "EOS_ID",
    "GLYPHS",
    "IGNORE_INDEX",
    "IMAGE_ID",
    "PAD_ID",
    "QTYPES",
    "SEP_ID",
    "SPECIAL_TOKENS",
    "SPLIT_BOUNDARY",
    "VOCAB",
    "WORD_TO_ID",
    "Episode",
    "EpisodeStream",
    "GridConfig",
    "answer_for",
    "cell_word",
    "collate",
    "collate_prompts",
    "collate_scenes",
    "decode",
    "digit_pool",
    "encode",
    "left_pad",
    "make_episode",
    "make_grid",
    "make_scene",
    "num_image_tokens",
    "render_image",
    "sample_image",
    "to_pil",
]


# --------------------------------------------------------------------------- questions


def cell_word(row: int, col: int) -> str:
    """The word naming cell ``(row, col)`` (0-based), e.g. ``cell_word(1, 2) == "r2c3"``."""
    if not (0 <= row < MAX_GRID and 0 <= col < MAX_GRID):
        raise ValueError(f"cell ({row}, {col}) is outside an {MAX_GRID}x{MAX_GRID} grid")
    return CELL_WORDS[row * MAX_GRID + col]


def answer_for(grid: torch.Tensor, qtype: str, meta: dict) -> list[str]:
    """The answer words to a question of ``qtype`` about ``meta`` on ``grid``."""
    if qtype == "what":
        v = int(grid[meta["row"], meta["col"]])
        return ["none"] if v < 0 else [DIGIT_WORDS[v]]
    if qtype == "where":
        hits = (grid == meta["digit"]).nonzero().tolist()
        if len(hits) != 1:
            raise ValueError(f"'where' needs a digit that occurs exactly once, got {len(hits)}")
        return [cell_word(*hits[0])]
    if qtype == "count":
        return [COUNT_WORDS[int((grid >= 0).sum())]]
    if qtype == "exists":
        return ["yes" if bool((grid == meta["digit"]).any()) else "no"]
    raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")


def _question(qtype: str, meta: dict) -> list[str]:
    if qtype == "what":
        return ["what", "is", "at", cell_word(meta["row"], meta["col"])]
    if qtype == "where":
        return ["where", "is", "the", "digit", DIGIT_WORDS[meta["digit"]]]
    if qtype == "count":
        return ["how", "many", "digits"]
    if qtype == "exists":
        return ["is", "there", "a", DIGIT_WORDS[meta["digit"]]]
    raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")


def _choose_meta(rng: random.Random, grid: torch.Tensor, qtype: str, config: GridConfig):
    """Pick what to ask about, or ``None`` when this grid cannot host the question."""
    g = config.grid
    if qtype == "what":
        occupied = [(r, c) for r in range(g) for c in range(g) if grid[r, c] >= 0]
        empty = [(r, c) for r in range(g) for c in range(g) if grid[r, c] < 0]
        want_occupied = rng.random() < config.what_occupied_p
        pool = occupied if want_occupied else empty
        if not pool:
            return None
        r, c = rng.choice(pool)
        return {"row": r, "col": c}
    if qtype == "where":
        counts = torch.bincount(grid[grid >= 0], minlength=10)
        unique = [d for d in range(10) if counts[d] == 1]
        if not unique:
            return None
        d = rng.choice(unique)
        ((r, c),) = (grid == d).nonzero().tolist()
        return {"digit": d, "row": r, "col": c}
    if qtype == "count":
        return {}
    if qtype == "exists":
        present = sorted({int(v) for v in grid.flatten().tolist() if v >= 0})
        absent = [d for d in range(10) if d not in present]
        pool = present if rng.random() < 0.5 else absent
        if not pool:
            return None
        return {"digit": rng.choice(pool)}
    raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")


def make_episode(
    rng: random.Random,
    split: str = "train",
    qtype: str | None = None,
    config: GridConfig = DEFAULT_CONFIG,
    *,
    max_tries: int = 1000,
) -> Episode:
    """Sample one episode; ``qtype=None`` picks one of `QTYPES` uniformly.

    All randomness comes from ``rng``, so a seeded ``random.Random`` makes it reproducible.
    Grids that cannot host the question (no unique digit for ``where``, no absent digit for a
    "no" ``exists``, ...) are resampled; the yes/no and occupied/empty draws are made per
    try, so resampling does not bias them toward the easy side.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if qtype is None:
        qtype = rng.choice(QTYPES)
    elif qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    for _ in range(max_tries):
        grid, index = make_grid(rng, split, config)
        meta = _choose_meta(rng, grid, qtype, config)
        if meta is not None:
            break
    else:
        raise RuntimeError(f"could not sample a {qtype!r} episode in {max_tries} tries")
    image = render_image(rng, index, config)
    return Episode(
        image=image,
        grid=grid,
        digit_index=index,
        question=_question(qtype, meta),
        answer=answer_for(grid, qtype, meta),
        qtype=qtype,
        split=split,
        meta=meta,
    )


def make_scene(
    rng: random.Random,
    split: str = "train",
    n_questions: int = 4,
    config: GridConfig = DEFAULT_CONFIG,
    qtypes: Sequence[str] = QTYPES,
) -> list[Episode]:
    """``n_questions`` episodes about one image (they share ``image``, ``grid``, ...).

    Each question's type is drawn from ``qtypes``; a type this grid cannot host (e.g. no
    unique digit for ``where``) is redrawn. Used to pack several questions per image when
    training (see `collate_scenes`).
    """
    if n_questions < 1:
        raise ValueError("n_questions must be >= 1")
    grid, index = make_grid(rng, split, config)
    image = render_image(rng, index, config)
    out: list[Episode] = []
    while len(out) < n_questions:
        qtype = rng.choice(tuple(qtypes))
        meta = _choose_meta(rng, grid, qtype, config)
        if meta is None:
            continue
        out.append(
            Episode(
                image=image,
                grid=grid,
                digit_index=index,
                question=_question(qtype, meta),
                answer=answer_for(grid, qtype, meta),
                qtype=qtype,
                split=split,
                meta=meta,
            )
        )
    return out


class EpisodeStream(_Stream):
    """An endless, seed-deterministic stream of DigitGrid episodes
    (`lightkv_lab.tasks.stream.EpisodeStream`)."""

    task = "digitgrid"
    QTYPES, SPLITS, DEFAULT_CONFIG = QTYPES, SPLITS, DEFAULT_CONFIG
    sample = staticmethod(make_episode)
