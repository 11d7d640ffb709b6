"""DigitGrid images: the digit glyphs, the grid layouts and the rendered pictures.

The handwritten digits (``sklearn.datasets.load_digits``, split by index into
`digit_pool`), the 5x7 bitmap font, the class hues (`hue_rgb`) and colour tiles;
`make_grid` samples which cells hold which digit, `render_image` draws a layout as a
``[3, H, W]`` tensor on seeded noise, `sample_image` does both, and `to_pil` converts an
image to 8-bit RGB for an image processor.
"""

from __future__ import annotations

import random
from functools import lru_cache

import torch

from lightkv_lab.tasks.digitgrid.config import DEFAULT_CONFIG, GridConfig
from lightkv_lab.tasks.digitgrid.vocab import SPLIT_BOUNDARY, SPLITS

__all__ = ["digit_pool", "hue_rgb", "make_grid", "render_image", "sample_image", "to_pil"]


# --------------------------------------------------------------------------- digits


@lru_cache(maxsize=1)
def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        # ModuleNotFoundError naming the module: the command line turns it into one line with the
        # extra
        raise ModuleNotFoundError(
            "DigitGrid needs scikit-learn, which is not installed: pip install scikit-learn",
            name="sklearn",
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


def _colour_tiles(
    image: torch.Tensor, digit_index: torch.Tensor, config: GridConfig, rng: random.Random
) -> torch.Tensor:
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
            ys, xs = (
                slice(r * cell + 1, (r + 1) * cell - 1),
                slice(c * cell + 1, (c + 1) * cell - 1),
            )
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


def sample_image(
    rng: random.Random, split: str, config: GridConfig = DEFAULT_CONFIG
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grid, image)`` of one fresh image (what the trainer's align stage draws)."""
    grid, index = make_grid(rng, split, config)
    return grid, render_image(rng, index, config)


def render_image(
    rng: random.Random, digit_index: torch.Tensor, config: GridConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """Draw the ``[3, H, W]`` image for a ``digit_index`` map (background noise seeded by
    ``rng``)."""
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
