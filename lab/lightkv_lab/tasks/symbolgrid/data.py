"""SymbolGrid-VQA: synthetic VQA whose answers need the content of single vision tokens.

An image is a ``G x G`` grid (16 x 16 by default) of ``cell``-pixel cells, one vision token
per cell (the tower's patch equals the cell). Every cell shows one of 32 symbols, a colour
(8 hues) times a shape (bar, post, dot, ring), drawn with random ink strength and texture
on a noisy background. Neighbouring cells almost always hold different symbols, so a merge
of two tokens mixes two answers: it keeps the answer only if the asked token dominates it.

Per image, a *rare set* of ``rare`` symbols is placed ``0..max_rare`` times each at random
cells; every other cell draws i.i.d. from the remaining symbols. Questions (word templates):

=========  ============================  ==========================================
qtype      question                      answer
=========  ============================  ==========================================
what       what is at r5c7               red-ring
read       read r5c3                     s(r5c3) r5c4 s(r5c4) r5c5 s(r5c5) r5c6 s(r5c6)
count      how many red-ring             n3        (a rare symbol: 0..max_rare)
exists     is there a red-ring           yes | no  (a rare symbol)
=========  ============================  ==========================================

``what`` and ``read`` are *detail* questions: the answer is one token's content. ``read``
answers with ``read_len`` symbols, each after the name of its cell, so all but the first
are read during decoding from the (compressed) cache. ``count`` and ``exists`` need the
whole image: dropping or diluting one rare token changes the answer.

Splits: ``train`` and ``heldout`` streams use different seeds; held-out layouts, strokes
and noise are new, the 32 symbol shapes are shared (as with DigitGrid's colour glyphs).
Sequences are ``<bos> <image>*n <sep> question [answer <eos>]``, left-padded, as in
`lightkv_lab.tasks.digitgrid.data` (same special-token ids).

This module holds the questions, the episodes (`make_episode`, `make_scene`, `EpisodeStream`)
and the batching; the rest lives below it and is re-exported here: the vocabulary and
constants in `lightkv_lab.tasks.symbolgrid.vocab`, `GridConfig` and `Episode` in
`lightkv_lab.tasks.symbolgrid.config`, the symbols and images in
`lightkv_lab.tasks.symbolgrid.images`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

# the task's data interface (`lightkv_lab.tasks.registry.Task.data`), as DigitGrid's
from lightkv_lab.tasks.digitgrid import data as _dg
from lightkv_lab.tasks.digitgrid.data import IGNORE_INDEX, to_pil
from lightkv_lab.tasks.stream import EpisodeStream as _Stream
from lightkv_lab.tasks.symbolgrid.config import DEFAULT_CONFIG, Episode, GridConfig
from lightkv_lab.tasks.symbolgrid.images import make_grid, render_image, sample_image
from lightkv_lab.tasks.symbolgrid.vocab import (
    BOS_ID,
    CELL_WORDS,
    CONTENT_IDS,
    COUNT_WORDS,
    DETAIL_QTYPES,
    EOS_ID,
    IMAGE_ID,
    MAX_GRID,
    PAD_ID,
    QTYPES,
    SEP_ID,
    SPECIAL_TOKENS,
    SPLITS,
    SYMBOL_WORDS,
    VOCAB,
    WORD_TO_ID,
    cell_word,
    decode,
    encode,
    symbol_word,
)

__all__ = [
    "BOS_ID",
    "CELL_WORDS",
    "CONTENT_IDS",
    "COUNT_WORDS",
    "DETAIL_QTYPES",
    "EOS_ID",
    "IGNORE_INDEX",
    "IMAGE_ID",
    "MAX_GRID",
    "PAD_ID",
    "QTYPES",
    "SEP_ID",
    "SPECIAL_TOKENS",
    "SYMBOL_WORDS",
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
    "encode",
    "make_episode",
    "make_grid",
    "make_scene",
    "num_image_tokens",
    "render_image",
    "sample_image",
    "symbol_word",
    "to_pil",
]

# --------------------------------------------------------------------------- questions


def answer_for(
    grid: torch.Tensor, qtype: str, meta: dict, config: GridConfig = DEFAULT_CONFIG
) -> list[str]:
    """The answer words to a question of ``qtype`` about ``meta`` on ``grid``."""
    if qtype == "what":
        return [SYMBOL_WORDS[int(grid[meta["row"], meta["col"]])]]
    if qtype == "read":
        r, c = meta["row"], meta["col"]
        if c + config.read_len > grid.shape[1]:
            raise ValueError(f"read from column {c} runs past the grid")
        out = [SYMBOL_WORDS[int(grid[r, c])]]
        for j in range(c + 1, c + config.read_len):
            out += [cell_word(r, j), SYMBOL_WORDS[int(grid[r, j])]]
        return out
    if qtype == "count":
        return [COUNT_WORDS[int((grid == meta["symbol"]).sum())]]
    if qtype == "exists":
        return ["yes" if bool((grid == meta["symbol"]).any()) else "no"]
    raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")


def _question(qtype: str, meta: dict) -> list[str]:
    if qtype == "what":
        return ["what", "is", "at", cell_word(meta["row"], meta["col"])]
    if qtype == "read":
        return ["read", cell_word(meta["row"], meta["col"])]
    if qtype == "count":
        return ["how", "many", SYMBOL_WORDS[meta["symbol"]]]
    if qtype == "exists":
        return ["is", "there", "a", SYMBOL_WORDS[meta["symbol"]]]
    raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")


def _choose_meta(
    rng: random.Random,
    grid: torch.Tensor,
    rare: tuple,
    qtype: str,
    config: GridConfig,
    want: bool | None = None,
):
    """Pick what to ask about, or ``None`` when this grid cannot host the question (``want``:
    the ``exists`` answer to ask for; drawn 50/50 when None)."""
    g = config.grid
    if qtype == "what":
        return {"row": rng.randrange(g), "col": rng.randrange(g)}
    if qtype == "read":
        return {"row": rng.randrange(g), "col": rng.randrange(g - config.read_len + 1)}
    if qtype == "count":
        return {"symbol": rng.choice(rare)}
    if qtype == "exists":
        want = rng.random() < 0.5 if want is None else want
        pool = [k for k in rare if bool((grid == k).any()) == want]
        return {"symbol": rng.choice(pool)} if pool else None
    raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")


def _episode(image, grid, rare, qtype, meta, split, config) -> Episode:
    return Episode(
        image=image,
        grid=grid,
        rare=rare,
        question=_question(qtype, meta),
        answer=answer_for(grid, qtype, meta, config),
        qtype=qtype,
        split=split,
        meta=meta,
    )


def make_episode(
    rng: random.Random,
    split: str = "train",
    qtype: str | None = None,
    config: GridConfig = DEFAULT_CONFIG,
    *,
    max_tries: int = 1000,
) -> Episode:
    """Sample one episode; ``qtype=None`` picks one of `QTYPES` uniformly. All randomness
    comes from ``rng``; grids that cannot host the question are resampled, keeping the
    ``exists`` answer drawn first, so yes and no are 50/50."""
    if qtype is None:
        qtype = rng.choice(QTYPES)
    elif qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    want = rng.random() < 0.5 if qtype == "exists" else None
    for _ in range(max_tries):
        grid, rare = make_grid(rng, split, config)
        meta = _choose_meta(rng, grid, rare, qtype, config, want)
        if meta is not None:
            break
    else:  # pragma: no cover - every grid hosts what/read/count
        raise RuntimeError(f"could not sample a {qtype!r} episode in {max_tries} tries")
    return _episode(render_image(rng, grid, config), grid, rare, qtype, meta, split, config)


def make_scene(
    rng: random.Random,
    split: str = "train",
    n_questions: int = 4,
    config: GridConfig = DEFAULT_CONFIG,
    qtypes: Sequence[str] = QTYPES,
) -> list[Episode]:
    """``n_questions`` episodes about one image (a conversation; see `collate_scenes`). The
    grid is fixed, so an ``exists`` question asks for "no" only where a rare symbol is absent
    (about one in three ``exists`` questions of a scene is a "no")."""
    if n_questions < 1:
        raise ValueError("n_questions must be >= 1")
    grid, rare = make_grid(rng, split, config)
    image = render_image(rng, grid, config)
    out: list[Episode] = []
    while len(out) < n_questions:
        qtype = rng.choice(tuple(qtypes))
        meta = _choose_meta(rng, grid, rare, qtype, config)
        if meta is not None:
            out.append(_episode(image, grid, rare, qtype, meta, split, config))
    return out


class EpisodeStream(_Stream):
    """An endless, seed-deterministic stream of SymbolGrid episodes
    (`lightkv_lab.tasks.stream.EpisodeStream`)."""

    task = "symbolgrid"
    QTYPES, SPLITS, DEFAULT_CONFIG = QTYPES, SPLITS, DEFAULT_CONFIG
    sample = staticmethod(make_episode)


# --------------------------------------------------------------------------- batching


def num_image_tokens(config: GridConfig = DEFAULT_CONFIG, patch: int | None = None) -> int:
    """Vision tokens of a SymbolGrid image: one per cell (``patch`` must equal the cell)."""
    if patch is not None and patch != config.cell:
        raise ValueError(
            f"SymbolGrid needs the tower's patch ({patch}) to equal the cell ({config.cell})"
        )
    return config.grid**2


def collate(
    episodes: Sequence[Episode], num_image_tokens: int, *, with_answer: bool = True
) -> dict[str, torch.Tensor]:
    """Batch episodes for a LLaVA-style model (`lightkv_lab.tasks.digitgrid.data.collate` with this
    vocabulary)."""
    return _dg.collate(episodes, num_image_tokens, with_answer=with_answer, encoder=encode)


def collate_prompts(episodes: Sequence[Episode], num_image_tokens: int) -> dict[str, torch.Tensor]:
    """Prompt-only batch (no answer, no ``labels``); every row's next token is the answer's
    first."""
    return collate(episodes, num_image_tokens, with_answer=False)


def collate_scenes(
    scenes: Sequence[Sequence[Episode]], num_image_tokens: int
) -> dict[str, torch.Tensor]:
    """One row per image: ``<bos> <image>*n <sep> q1 a1 <eos> q2 a2 <eos> ...``."""
    return _dg.collate_scenes(scenes, num_image_tokens, encoder=encode)
