"""SymbolGrid images: the symbols' shapes and colours, the grid layouts and the pictures.

`make_grid` samples the symbol of every cell and the image's rare symbols, `render_image`
draws a grid as a ``[3, H, W]`` tensor (ink strength and texture on seeded noise), and
`sample_image` does both.
"""

from __future__ import annotations

import random
from functools import lru_cache

import torch

from lightkv_lab.tasks.digitgrid.images import hue_rgb
from lightkv_lab.tasks.symbolgrid.config import DEFAULT_CONFIG, GridConfig
from lightkv_lab.tasks.symbolgrid.vocab import COLOURS, SHAPES, SPLITS, SYMBOL_WORDS

__all__ = ["make_grid", "render_image", "sample_image"]


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
    return torch.stack([hue_rgb(k / len(COLOURS)) for k in range(len(COLOURS))])


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
