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
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from lightkv_lab.tasks.digitgrid import data as _dg
from lightkv_lab.tasks.digitgrid.data import IGNORE_INDEX, to_pil
from lightkv_lab.tasks.stream import EpisodeStream as _Stream

__all__ = [
    "BOS_ID",
    "CELL_WORDS",
    "COUNT_WORDS",
    "DETAIL_QTYPES",
    "EOS_ID",
    "IGNORE_INDEX",
    "IMAGE_ID",
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


@dataclass(frozen=True)
class GridConfig:
    """Geometry and sampling knobs of SymbolGrid images and questions."""

    grid: int = 16
    """Cells (= vision tokens) per side."""
    cell: int = 4
    """Cell side in pixels (the vision tower's patch)."""
    rare: int = 4
    """Symbols per image placed a controlled number of times (the count/exists subjects)."""
    max_rare: int = 5
    """Each rare symbol occurs ``0..max_rare`` times."""
    read_len: int = 4
    """Symbols a ``read`` question answers (its cell and the next ``read_len - 1`` to the right)."""
    noise: float = 0.2
    """Background is uniform noise in ``[0, noise]``."""
    asked: tuple[str, ...] = QTYPES
    """Question types the evaluation asks (held-out episodes, conversations, benchmark);
    training always draws from all of `QTYPES`. A model records the ones it answers."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "asked", tuple(self.asked))  # JSON gives a list
        if not self.asked or any(q not in QTYPES for q in self.asked):
            raise ValueError(f"asked must be a non-empty subset of {QTYPES}, got {self.asked}")
        if not 2 <= self.grid <= MAX_GRID:
            raise ValueError(f"grid must be in [2, {MAX_GRID}], got {self.grid}")
        if self.cell < 4:
            raise ValueError(
                f"cell must be >= 4 pixels (a symbol is drawn on 4x4), got {self.cell}"
            )
        if not 1 <= self.rare < len(SYMBOL_WORDS) or not 0 <= self.max_rare <= MAX_COUNT:
            raise ValueError(
                f"need 1 <= rare < {len(SYMBOL_WORDS)} and 0 <= max_rare <= {MAX_COUNT}"
            )
        if self.rare * self.max_rare > self.grid**2:
            raise ValueError("rare * max_rare exceeds the number of cells")
        if not 1 <= self.read_len <= self.grid:
            raise ValueError(f"read_len must be in [1, grid], got {self.read_len}")
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError("noise must be in [0, 1]")

    @property
    def image_size(self) -> int:
        return self.grid * self.cell


DEFAULT_CONFIG = GridConfig()


@dataclass
class Episode:
    """One image with one question and its answer."""

    image: torch.Tensor
    """float32 ``[3, H, W]`` in ``[0, 1]``."""
    grid: torch.Tensor
    """int64 ``[G, G]``: symbol index per cell."""
    rare: tuple[int, ...]
    """The image's rare symbols."""
    question: list[str]
    answer: list[str]
    qtype: str
    split: str
    meta: dict = field(default_factory=dict)
    """What was asked: ``{"row", "col"}`` (0-based) for what/read, ``{"symbol"}`` for
    count/exists."""


# --------------------------------------------------------------------------- symbols


@lru_cache(maxsize=1)
def _shapes() -> torch.Tensor:
    """``[4, 4, 4]`` ink masks of the shapes on a 4x4 cell."""
    m = torch.zeros(4, 4, 4)
    m[0, 1:3, :] = 1  # bar: a horizontal band
    m[1, :, 1:3] = 1  # post: a vertical band
    m[2, 1:3, 1:3] = 1  # dot: the centre
    m[3] = 1
    m[3, 1:3, 1:3] = 0  # ring: the border
    return m


@lru_cache(maxsize=1)
def _colours() -> torch.Tensor:
    """``[8, 3]`` fully saturated RGB of hues ``k / 8``."""
    return torch.stack([_dg.hue_rgb(k / len(COLOURS)) for k in range(len(COLOURS))])


def symbol_word(k: int) -> str:
    return SYMBOL_WORDS[k]


def cell_word(row: int, col: int) -> str:
    """The word naming cell ``(row, col)`` (0-based), e.g. ``cell_word(4, 6) == "r5c7"``."""
    if not (0 <= row < MAX_GRID and 0 <= col < MAX_GRID):
        raise ValueError(f"cell ({row}, {col}) is outside a {MAX_GRID}x{MAX_GRID} grid")
    return CELL_WORDS[row * MAX_GRID + col]


# --------------------------------------------------------------------------- grids and images


def make_grid(
    rng: random.Random, split: str, config: GridConfig = DEFAULT_CONFIG
) -> tuple[torch.Tensor, tuple]:
    """Sample ``(grid, rare)``: the symbol of every cell and the image's rare symbols."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    g, n_sym = config.grid, len(SYMBOL_WORDS)
    rare = tuple(rng.sample(range(n_sym), config.rare))
    common = [k for k in range(n_sym) if k not in rare]
    cells = [rng.choice(common) for _ in range(g * g)]
    free = list(range(g * g))
    rng.shuffle(free)
    for k in rare:
        for _ in range(rng.randint(0, config.max_rare)):
            cells[free.pop()] = k
    return torch.tensor(cells, dtype=torch.int64).reshape(g, g), rare


def sample_image(
    rng: random.Random, split: str, config: GridConfig = DEFAULT_CONFIG
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grid, image)`` of one fresh image (what the trainer's align stage draws)."""
    grid, _ = make_grid(rng, split, config)
    return grid, render_image(rng, grid, config)


def render_image(
    rng: random.Random, grid: torch.Tensor, config: GridConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """Draw the ``[3, H, W]`` image of a symbol grid (noise, ink and texture seeded by ``rng``)."""
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    g, cell = config.grid, config.cell
    flat = grid.flatten()
    shape = _shapes()[flat % len(SHAPES)]  # [N, 4, 4]
    colour = _colours()[flat // len(SHAPES)]  # [N, 3]
    ink = 0.65 + 0.35 * torch.rand((flat.numel(), 1, 1), generator=gen)
    texture = 0.8 + 0.2 * torch.rand((flat.numel(), 4, 4), generator=gen)
    glyph = shape * ink * texture  # [N, 4, 4]
    if cell > 4:  # centre the 4x4 symbol, scaled by nearest neighbour to the largest fit
        s = cell // 4
        glyph = glyph.repeat_interleave(s, 1).repeat_interleave(s, 2)
        pad = cell - 4 * s
        glyph = torch.nn.functional.pad(glyph, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))
    noise = torch.rand((3, g * cell, g * cell), generator=gen) * config.noise
    ink_rgb = glyph[:, None] * colour[:, :, None, None]  # [N, 3, cell, cell]
    ink_rgb = (
        ink_rgb.reshape(g, g, 3, cell, cell).permute(2, 0, 3, 1, 4).reshape(3, g * cell, g * cell)
    )
    return torch.maximum(noise, ink_rgb).clamp_(0.0, 1.0)


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
    """An endless, seed-deterministic stream of SymbolGrid episodes (`lightkv_lab.tasks.stream.EpisodeStream`)."""

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
    """Prompt-only batch (no answer, no ``labels``); every row's next token is the answer's first."""
    return collate(episodes, num_image_tokens, with_answer=False)


def collate_scenes(
    scenes: Sequence[Sequence[Episode]], num_image_tokens: int
) -> dict[str, torch.Tensor]:
    """One row per image: ``<bos> <image>*n <sep> q1 a1 <eos> q2 a2 <eos> ...``."""
    return _dg.collate_scenes(scenes, num_image_tokens, encoder=encode)
