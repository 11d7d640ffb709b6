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
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

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
    "what", "is", "at", "where", "the", "digit",
    "how", "many", "digits", "there", "a",
)
ANSWER_WORDS = ("none", "yes", "no")

VOCAB: tuple[str, ...] = (
    SPECIAL_TOKENS + TEMPLATE_WORDS + ANSWER_WORDS + DIGIT_WORDS + CELL_WORDS
    + COUNT_WORDS
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


@dataclass(frozen=True)
class GridConfig:
    """Geometry and sampling knobs of DigitGrid images and questions."""

    grid: int = 4
    """Cells per side."""
    cell: int = 16
    """Cell side in pixels."""
    scale: int = 2
    """Nearest-neighbour upscaling of the 8x8 digits (digit side = ``8 * scale``)."""
    min_digits: int = 3
    max_digits: int = 8
    jitter: int = 0
    """Maximum per-digit shift in pixels (each axis, uniform in ``[-jitter, jitter]``)."""
    noise: float = 0.15
    """Background is uniform noise in ``[0, noise]``."""
    tint: float = 0.0
    """0 gives grey images; > 0 scales each channel by a random factor in ``[1 - tint, 1]``."""
    what_occupied_p: float = 0.5
    """Probability that a ``what`` question asks an occupied cell (else an empty one)."""
    glyphs: str = "colour"
    """``"colour"`` (the default, what the bundled model was trained on): the font digit on a
    tile, both in the class's own hue (``k / 10`` of the colour wheel), so every patch of an
    occupied cell shows its class; ``"font"``: a 5x7 bitmap font with per-instance stroke
    intensity and placement (both splits share the glyph shapes); ``"handwritten"``: sklearn
    digits (split by index)."""

    def __post_init__(self) -> None:
        if not 1 <= self.grid <= MAX_GRID:
            raise ValueError(f"grid must be in [1, {MAX_GRID}], got {self.grid}")
        if not 0 <= self.min_digits <= self.max_digits <= min(MAX_COUNT, self.grid**2):
            raise ValueError(
                f"need 0 <= min_digits <= max_digits <= {min(MAX_COUNT, self.grid ** 2)}, "
                f"got {self.min_digits}, {self.max_digits}"
            )
        if self.max_digits < 1:
            raise ValueError("max_digits must be >= 1")
        if self.cell < 1 or self.scale < 1 or self.jitter < 0:
            raise ValueError("cell and scale must be >= 1 and jitter >= 0")
        if not 0.0 <= self.noise <= 1.0 or not 0.0 <= self.tint <= 1.0:
            raise ValueError("noise and tint must be in [0, 1]")
        if not 0.0 <= self.what_occupied_p <= 1.0:
            raise ValueError("what_occupied_p must be in [0, 1]")
        if self.glyphs not in GLYPHS:
            raise ValueError(f"glyphs must be one of {GLYPHS}, got {self.glyphs!r}")

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
    """int64 ``[G, G]``: digit class per cell, -1 where empty."""
    digit_index: torch.Tensor
    """int64 ``[G, G]``: sklearn ``load_digits`` index drawn in each cell (the class, for font
    glyphs), -1 where empty."""
    question: list[str]
    answer: list[str]
    qtype: str
    split: str
    meta: dict = field(default_factory=dict)
    """What was asked: ``{"row", "col"}`` for what/where (0-based), ``{"digit"}`` for
    where/exists."""


# --------------------------------------------------------------------------- digits


@lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "DigitGrid needs scikit-learn (pip install 'lightkv[demo]' or scikit-learn)"
        ) from e
    d = load_digits()
    images = torch.as_tensor(d.images, dtype=torch.float32) / 16.0
    targets = torch.as_tensor(d.target, dtype=torch.int64)
    return images, targets


# A 5x7 bitmap font (our own drawing): '#' is ink.
_FONT = {
    0: (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    1: ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    2: (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    3: ("####.", "....#", "....#", ".###.", "....#", "....#", "####."),
    4: ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    5: ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    6: ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    7: ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    8: (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    9: (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
}


@lru_cache(maxsize=1)
def _font() -> torch.Tensor:
    """``[10, 7, 5]`` ink masks of the bitmap font."""
    return torch.tensor(
        [[[ch == "#" for ch in row] for row in _FONT[d]] for d in range(10)], dtype=torch.float32
    )


def _font_glyph(cls: int, rng: random.Random, gen: torch.Generator) -> torch.Tensor:
    """An 8x8 font digit: random placement in the 8x8 box, ink strength and stroke texture."""
    glyph = torch.zeros(8, 8)
    y, x = rng.randint(0, 1), rng.randint(0, 3)
    ink = 0.55 + 0.45 * rng.random()
    texture = 0.7 + 0.3 * torch.rand((7, 5), generator=gen)
    glyph[y : y + 7, x : x + 5] = _font()[cls] * texture * ink
    return glyph


def hue_rgb(fraction: float) -> torch.Tensor:
    """Fully saturated RGB ``[3]`` of hue ``fraction`` of the colour wheel (HSV, S = V = 1)."""
    h = fraction * 6
    x = 1 - abs(h % 2 - 1)
    table = [(1, x, 0), (x, 1, 0), (0, 1, x), (0, x, 1), (x, 0, 1), (1, 0, x)]
    return torch.tensor(table[int(h) % 6], dtype=torch.float32)


def _hue(cls: int) -> torch.Tensor:
    """The hue of digit class ``cls``: ``cls / 10`` of the wheel."""
    return hue_rgb(cls / 10)


def _colour_tiles(image: torch.Tensor, digit_index: torch.Tensor, config: GridConfig,
                  rng: random.Random) -> torch.Tensor:
    """Colour every occupied cell in its class hue: a dim tile (1-pixel margin) under the
    grey glyph, which takes the hue at full strength."""
    cell = config.cell
    out = image.clone()
    for r in range(config.grid):
        for c in range(config.grid):
            cls = int(digit_index[r, c])
            if cls < 0:
                continue
            hue = _hue(cls)[:, None, None]
            ys, xs = slice(r * cell + 1, (r + 1) * cell - 1), slice(c * cell + 1, (c + 1) * cell - 1)
            grey = image[0, ys, xs]
            tile = 0.3 + 0.15 * rng.random()
            out[:, ys, xs] = hue * torch.maximum(grey, torch.full_like(grey, tile))
    return out


@lru_cache(maxsize=2)
def digit_pool(split: str) -> tuple[tuple[int, ...], ...]:
    """For each class 0-9, the sklearn indices that ``split`` may draw from."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    _, targets = _digits()
    n = targets.numel()
    idx = range(SPLIT_BOUNDARY) if split == "train" else range(SPLIT_BOUNDARY, n)
    pools: list[list[int]] = [[] for _ in range(10)]
    for i in idx:
        pools[int(targets[i])].append(i)
    return tuple(tuple(p) for p in pools)


# --------------------------------------------------------------------------- grids and images


def make_grid(
    rng: random.Random, split: str, config: GridConfig = DEFAULT_CONFIG
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``(grid, digit_index)``: which cells hold which class, from which sklearn image."""
    pools = digit_pool(split)
    g = config.grid
    n = rng.randint(config.min_digits, config.max_digits)
    cells = rng.sample(range(g * g), n)
    grid = torch.full((g, g), -1, dtype=torch.int64)
    index = torch.full((g, g), -1, dtype=torch.int64)
    for c in cells:
        cls = rng.randrange(10)
        grid[c // g, c % g] = cls
        # font glyphs have no sklearn image: the index map then holds the class
        index[c // g, c % g] = cls if config.glyphs != "handwritten" else rng.choice(pools[cls])
    return grid, index


def sample_image(rng: random.Random, split: str, config: GridConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grid, image)`` of one fresh image (what the trainer's align stage draws)."""
    grid, index = make_grid(rng, split, config)
    return grid, render_image(rng, index, config)


def render_image(
    rng: random.Random, digit_index: torch.Tensor, config: GridConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """Draw the ``[3, H, W]`` image for a ``digit_index`` map (background noise seeded by ``rng``)."""
    images = _digits()[0] if config.glyphs == "handwritten" else None
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    size, cell, g = config.image_size, config.cell, config.grid
    canvas = torch.rand((size, size), generator=gen) * config.noise
    side = 8 * config.scale
    for r in range(g):
        for c in range(g):
            i = int(digit_index[r, c])
            if i < 0:
                continue
            base = _font_glyph(i, rng, gen) if images is None else images[i]
            glyph = base.repeat_interleave(config.scale, 0).repeat_interleave(config.scale, 1)
            dy = dx = 0
            if config.jitter:
                dy = rng.randint(-config.jitter, config.jitter)
                dx = rng.randint(-config.jitter, config.jitter)
            # glyph top-left, in cell coordinates (centred, then shifted)
            y0 = (cell - side) // 2 + dy
            x0 = (cell - side) // 2 + dx
            # intersect the glyph's box with the cell
            cy0, cy1 = max(0, y0), min(cell, y0 + side)
            cx0, cx1 = max(0, x0), min(cell, x0 + side)
            if cy0 >= cy1 or cx0 >= cx1:
                continue
            patch = glyph[cy0 - y0 : cy1 - y0, cx0 - x0 : cx1 - x0]
            region = canvas[r * cell + cy0 : r * cell + cy1, c * cell + cx0 : c * cell + cx1]
            torch.maximum(region, patch, out=region)
    image = canvas.unsqueeze(0).repeat(3, 1, 1)
    if config.glyphs == "colour":
        image = _colour_tiles(image, digit_index, config, rng)
    if config.tint > 0:
        factors = 1.0 - config.tint * torch.rand((3, 1, 1), generator=gen)
        image = image * factors
    return image.clamp_(0.0, 1.0)


def to_pil(image: torch.Tensor):
    """A ``[3, H, W]`` image in ``[0, 1]`` as an 8-bit RGB PIL image (what a processor reads)."""
    from PIL import Image

    pixels = (image.clamp(0, 1).permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    return Image.fromarray(pixels)


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
        (r, c), = (grid == d).nonzero().tolist()
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
        out.append(Episode(image=image, grid=grid, digit_index=index, question=_question(qtype, meta),
                           answer=answer_for(grid, qtype, meta), qtype=qtype, split=split, meta=meta))
    return out


class EpisodeStream:
    """An endless, seed-deterministic stream of episodes.

    Two streams with the same ``(seed, split, qtypes, config)`` yield identical episodes.
    ``qtypes`` restricts (and, with repeats, weights) the question types drawn.
    """

    def __init__(
        self,
        seed: int,
        split: str = "train",
        *,
        qtypes: Sequence[str] | None = None,
        config: GridConfig = DEFAULT_CONFIG,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        qtypes = tuple(QTYPES if qtypes is None else qtypes)
        if not qtypes or any(q not in QTYPES for q in qtypes):
            raise ValueError(f"qtypes must be a non-empty subset of {QTYPES}, got {qtypes}")
        self.seed, self.split, self.qtypes, self.config = seed, split, qtypes, config
        self._rng = random.Random(f"digitgrid:{seed}:{split}")

    def __iter__(self) -> Iterator[Episode]:
        return self

    def __next__(self) -> Episode:
        qtype = self._rng.choice(self.qtypes)
        return make_episode(self._rng, self.split, qtype, self.config)

    def take(self, n: int) -> list[Episode]:
        return [next(self) for _ in range(n)]


# --------------------------------------------------------------------------- batching


def num_image_tokens(config: GridConfig = DEFAULT_CONFIG, patch: int = 4) -> int:
    """Vision tokens a ViT with ``patch``-pixel patches produces (``(H / patch) ** 2``)."""
    if config.image_size % patch:
        raise ValueError(f"image size {config.image_size} is not a multiple of patch {patch}")
    return (config.image_size // patch) ** 2


def collate(
    episodes: Sequence[Episode], num_image_tokens: int, *, with_answer: bool = True,
    encoder: Callable[[Sequence[str]], list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Batch episodes for a LLaVA-style model.

    Each row is ``<bos> <image>*num_image_tokens <sep> question`` followed, when
    ``with_answer``, by ``answer <eos>``; rows are left-padded with ``<pad>`` (mask 0).
    Returns ``input_ids`` and ``attention_mask`` ``[B, L]`` (int64), ``pixel_values``
    ``[B, 3, H, W]`` and, when ``with_answer``, ``labels`` ``[B, L]``: ``input_ids`` on the
    answer and ``<eos>`` tokens, -100 elsewhere (unshifted; the model shifts). ``encoder``
    maps words to ids (default: this vocabulary's `encode`; another task passes its own,
    with the same special-token ids).
    """
    encode_ = encoder or encode
    if not episodes:
        raise ValueError("collate needs at least one episode")
    if num_image_tokens < 0:
        raise ValueError("num_image_tokens must be >= 0")
    rows, label_rows = [], []
    for ep in episodes:
        prompt = [BOS_ID] + [IMAGE_ID] * num_image_tokens + [SEP_ID] + encode_(ep.question)
        if with_answer:
            target = encode_(ep.answer) + [EOS_ID]
            rows.append(prompt + target)
            label_rows.append([IGNORE_INDEX] * len(prompt) + target)
        else:
            rows.append(prompt)
    batch = left_pad(rows, label_rows if with_answer else None)
    batch["pixel_values"] = torch.stack([ep.image for ep in episodes])
    return batch


def left_pad(rows: list[list[int]], label_rows: list[list[int]] | None, pad_id: int = PAD_ID) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` (and ``labels``) ``[B, L]``, left-padded with ``pad_id``."""
    length = max(len(r) for r in rows)
    b = len(rows)
    out = {"input_ids": torch.full((b, length), pad_id, dtype=torch.int64),
           "attention_mask": torch.zeros((b, length), dtype=torch.int64)}
    if label_rows is not None:
        out["labels"] = torch.full((b, length), IGNORE_INDEX, dtype=torch.int64)
    for i, row in enumerate(rows):
        out["input_ids"][i, length - len(row):] = torch.tensor(row)
        out["attention_mask"][i, length - len(row):] = 1
        if label_rows is not None:
            out["labels"][i, length - len(row):] = torch.tensor(label_rows[i])
    return out


def collate_scenes(scenes: Sequence[Sequence[Episode]], num_image_tokens: int,
                   encoder: Callable[[Sequence[str]], list[int]] | None = None) -> dict[str, torch.Tensor]:
    """Batch scenes (several questions about one image) as one sequence per image.

    A row is ``<bos> <image>*n <sep> q1 a1 <eos> q2 a2 <eos> ...``: its first
    question looks exactly like a `collate` row, so training on scenes teaches the
    single-question format while amortising the image tokens over several answers.
    ``encoder`` as in `collate`.
    """
    encode_ = encoder or encode
    if not scenes or any(not s for s in scenes):
        raise ValueError("collate_scenes needs at least one scene, each with at least one episode")
    rows, label_rows = [], []
    for scene in scenes:
        row = [BOS_ID] + [IMAGE_ID] * num_image_tokens + [SEP_ID]
        lab = [IGNORE_INDEX] * len(row)
        for ep in scene:
            q = encode_(ep.question)
            a = encode_(ep.answer) + [EOS_ID]
            row += q + a
            lab += [IGNORE_INDEX] * len(q) + a
        rows.append(row)
        label_rows.append(lab)
    batch = left_pad(rows, label_rows)
    batch["pixel_values"] = torch.stack([scene[0].image for scene in scenes])
    return batch


def collate_prompts(
    episodes: Sequence[Episode], num_image_tokens: int,
    encoder: Callable[[Sequence[str]], list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Prompt-only batch for evaluation/generation (no answer, no ``labels``).

    Rows end with the question's last word, so with left padding every row's next token is
    the first answer word; compare generations with ``episode.answer``.
    """
    return collate(episodes, num_image_tokens, with_answer=False, encoder=encoder)
