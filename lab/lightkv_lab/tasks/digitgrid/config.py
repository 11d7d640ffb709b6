"""The two records the DigitGrid modules pass around: `GridConfig` and `Episode`.

`GridConfig` holds the geometry and sampling knobs of the images and questions (validated
on construction; `DEFAULT_CONFIG` is what the bundled model was trained on), and
`Episode` is one image with one question and its answer. The image code, the batching and
the episode sampling all take these, so they live below all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightkv_lab.tasks.digitgrid.vocab import GLYPHS, MAX_COUNT, MAX_GRID

__all__ = ["DEFAULT_CONFIG", "Episode", "GridConfig"]


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
                f"need 0 <= min_digits <= max_digits <= {min(MAX_COUNT, self.grid**2)}, "
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
