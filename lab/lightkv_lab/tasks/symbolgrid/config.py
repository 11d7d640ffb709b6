"""The two records the SymbolGrid modules pass around: `GridConfig` and `Episode`.

`GridConfig` holds the geometry and sampling knobs of the images and questions (validated on
construction; `DEFAULT_CONFIG` is what the bundled model was trained on), and `Episode` is
one image with one question and its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightkv_lab.tasks.symbolgrid.vocab import MAX_COUNT, MAX_GRID, QTYPES, SYMBOL_WORDS

__all__ = ["DEFAULT_CONFIG", "Episode", "GridConfig"]


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
