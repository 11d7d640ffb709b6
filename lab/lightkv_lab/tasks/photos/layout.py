"""Photos-VQA layouts: what one image shows (photograph crop, objects, dots, sign), how it is
sampled, and which of the 16 x 16 patches each thing covers."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lightkv_lab.tasks.photos.images import IMAGE_SIZE, draw_layout, shape_mask
from lightkv_lab.tasks.photos.tower import PATCH
from lightkv_lab.tasks.photos.vocab import (
    COLOURS,
    KINDS,
    LETTERS,
    MAX_COUNT,
    MIX,
    QTYPES,
    SCENES,
    SPLITS,
)

__all__ = [
    "DEFAULT_CONFIG",
    "MIX_QTYPES",
    "Dot",
    "GridConfig",
    "Layout",
    "Obj",
    "make_layout",
    "patches",
    "render_image",
    "sample_image",
    "sign_patches",
]

MIX_QTYPES: tuple[str, ...] = tuple(q for q in QTYPES for _ in range(round(MIX[q] * 20)))
"""`QTYPES` repeated in proportion to `MIX` (20 entries): round-robin over it draws the mix."""
SIDE = IMAGE_SIZE // PATCH


@dataclass(frozen=True)
class GridConfig:
    """Geometry of Photos images and the question types evaluation asks (with repeats: the
    shares; default `MIX_QTYPES`)."""

    grid: int = IMAGE_SIZE // PATCH
    asked: tuple[str, ...] = MIX_QTYPES

    def __post_init__(self) -> None:
        object.__setattr__(self, "asked", tuple(self.asked))  # JSON gives a list
        if not self.asked or any(q not in QTYPES for q in self.asked):
            raise ValueError(f"asked must be question types of {QTYPES}, got {self.asked}")
        if self.grid != IMAGE_SIZE // PATCH:
            raise ValueError(f"grid must be {IMAGE_SIZE // PATCH} (224 px, 14 px patches)")

    @property
    def image_size(self) -> int:
        return IMAGE_SIZE

    @property
    def cell(self) -> int:
        return PATCH


DEFAULT_CONFIG = GridConfig()


@dataclass(frozen=True)
class Obj:
    """An object centred at pixel ``(x, y)``, ``size`` px wide; role big, medium or small."""

    kind: str
    colour: str
    x: int
    y: int
    size: int
    role: str


@dataclass(frozen=True)
class Dot:
    colour: str
    x: int
    y: int
    size: int


@dataclass(frozen=True)
class Layout:
    """Everything `render_image` draws (and the questions ask about)."""

    scene: str
    crop: tuple[float, float, float]
    flip: bool
    brightness: float
    objects: tuple[Obj, ...]
    dots: tuple[Dot, ...]
    sign: tuple[int, int, tuple[str, ...]]
    """``(x, y, letters)``: the plate's top-left pixel and its letters (None: no sign, as in
    `lightkv_lab.tasks.photos.realism`'s photographs alone)."""
    seed: int

    def role(self, role: str) -> list[Obj]:
        return [o for o in self.objects if o.role == role]


def _free(boxes, box, margin: int = 4) -> bool:
    x0, y0, x1, y1 = box
    return all(
        x1 + margin <= a0 or a1 + margin <= x0 or y1 + margin <= b0 or b1 + margin <= y0
        for a0, b0, a1, b1 in boxes
    )


def _place(rng, boxes, w: int, h: int, tries: int = 200):
    for _ in range(tries):
        x, y = rng.randint(2, IMAGE_SIZE - w - 2), rng.randint(2, IMAGE_SIZE - h - 2)
        if _free(boxes, (x, y, x + w, y + h)):
            boxes.append((x, y, x + w, y + h))
            return x, y
    return None


def make_layout(rng: random.Random, split: str, config: GridConfig = DEFAULT_CONFIG) -> Layout:
    """Sample one image's layout (all randomness from ``rng``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    while True:
        boxes: list = []
        kinds = rng.sample(KINDS, 4)
        objects = []
        sizes = [rng.randint(76, 104)] + [rng.randint(40, 60) for _ in range(rng.randint(1, 2))]
        roles = ["big"] + ["medium"] * (len(sizes) - 1) + ["small"]
        sizes.append(rng.randint(16, 22))
        for kind, size, role in zip(kinds, sizes, roles):
            at = _place(rng, boxes, size, size)
            if at is None:
                break
            objects.append(
                Obj(kind, rng.choice(COLOURS), at[0] + size // 2, at[1] + size // 2, size, role)
            )
        sign_at = _place(rng, boxes, 14 * 3 + 8, 24)
        if len(objects) == len(sizes) and sign_at is not None:
            break
    dots = []
    for colour in rng.sample(COLOURS, rng.randint(1, 2)):
        for _ in range(rng.randint(0, MAX_COUNT)):
            size = rng.randint(8, 10)
            at = _place(rng, boxes, size, size)
            if at is not None:
                dots.append(Dot(colour, at[0] + size // 2, at[1] + size // 2, size))
    crop = (rng.uniform(0.5, 1.0), rng.random(), rng.random())
    return Layout(
        scene=rng.choice(SCENES),
        crop=crop,
        flip=rng.random() < 0.5,
        brightness=rng.uniform(0.85, 1.1),
        objects=tuple(objects),
        dots=tuple(dots),
        sign=(sign_at[0], sign_at[1], tuple(rng.choice(LETTERS) for _ in range(3))),
        seed=rng.getrandbits(63),
    )


def render_image(layout: Layout) -> torch.Tensor:
    """``[3, 224, 224]`` float32 in ``[0, 1]``."""
    return draw_layout(layout)


def sample_image(rng: random.Random, split: str, config: GridConfig = DEFAULT_CONFIG):
    """``(big object's patches bool [16, 16], image)`` of one fresh image."""
    layout = make_layout(rng, split, config)
    return patches(layout, layout.role("big")), render_image(layout)


# --------------------------------------------------------------------------- regions


def _coverage(obj_size: int, x: int, y: int, kind: str = "ball") -> np.ndarray:
    canvas = np.zeros((IMAGE_SIZE, IMAGE_SIZE), np.float32)
    mask = shape_mask(kind, obj_size)
    top, left = int(round(y - obj_size / 2)), int(round(x - obj_size / 2))
    t0, l0 = max(0, top), max(0, left)
    t1, l1 = min(IMAGE_SIZE, top + obj_size), min(IMAGE_SIZE, left + obj_size)
    canvas[t0:t1, l0:l1] = mask[t0 - top : t1 - top, l0 - left : l1 - left]
    return canvas


def _pool(canvas: np.ndarray) -> torch.Tensor:
    g = SIDE
    return torch.from_numpy(canvas.reshape(g, PATCH, g, PATCH).mean((1, 3)) > 0.1)


def patches(layout: Layout, objects: Sequence[Obj] = (), dots: Sequence[Dot] = ()):
    """bool ``[16, 16]``: patches at least 10% covered by ``objects`` / ``dots``."""
    canvas = np.zeros((IMAGE_SIZE, IMAGE_SIZE), np.float32)
    for o in objects:
        canvas = np.maximum(canvas, _coverage(o.size, o.x, o.y, o.kind))
    for d in dots:
        canvas = np.maximum(canvas, _coverage(d.size, d.x, d.y) * 4)  # a dot is < 1 patch
    return _pool(canvas)


def sign_patches(layout: Layout) -> torch.Tensor:
    canvas = np.zeros((IMAGE_SIZE, IMAGE_SIZE), np.float32)
    x, y, letters = layout.sign
    canvas[y : y + 24, x : x + 14 * len(letters) + 8] = 1
    return _pool(canvas)
