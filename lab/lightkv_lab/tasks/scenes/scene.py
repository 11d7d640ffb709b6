"""Scenes-VQA images: the layout of a scene (ground, objects, gems, sign), its per-token
labels, and the rendered pixels."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from lightkv_lab.tasks.digitgrid.images import hue_rgb
from lightkv_lab.tasks.scenes.vocab import (
    COLOURS,
    GLYPHS,
    HORIZONTAL,
    MATERIALS,
    MAX_COUNT,
    QTYPES,
    SLOTS,
    SPLITS,
    TEXTURES,
    VERTICAL,
    _ids,
)

__all__ = [
    "DEFAULT_CONFIG",
    "GridConfig",
    "Obj",
    "Scene",
    "make_layout",
    "render_image",
    "sample_image",
]


@dataclass(frozen=True)
class GridConfig:
    """Geometry and sampling knobs of Scenes images and questions."""

    grid: int = 16
    """Tokens per side (even: the image has four quadrants)."""
    cell: int = 4
    """Token side in pixels (the vision tower's patch)."""
    min_objects: int = 2
    max_objects: int = 5
    max_gem_colours: int = 3
    """Colours that get 0..3 gems each."""
    noise: float = 0.06
    """Per-pixel noise amplitude (uniform in ``[-noise, noise]``)."""
    busy: float = 0.0
    """Contrast of a busy ground: every ground token gets one of the object textures at
    random, brightening its inked pixels by ``1 + busy`` (0: the plain material texture;
    the trained model never saw a busy ground: a held-out construction)."""
    asked: tuple[str, ...] = QTYPES
    """Question types evaluation asks; training draws from all of `QTYPES`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "asked", tuple(self.asked))  # JSON gives a list
        if not self.asked or any(q not in QTYPES for q in self.asked):
            raise ValueError(f"asked must be a non-empty subset of {QTYPES}, got {self.asked}")
        if self.grid % 2 or not 10 <= self.grid <= 32:
            raise ValueError(
                f"grid must be even and in [10, 32] (four quadrants of objects), got {self.grid}"
            )
        if self.cell != 4:
            raise ValueError(
                f"cell must be 4 pixels (textures and glyphs are drawn on 4x4), got {self.cell}"
            )
        if not 1 <= self.min_objects <= self.max_objects <= len(COLOURS):
            raise ValueError(f"need 1 <= min_objects <= max_objects <= {len(COLOURS)}")
        if not 0 <= self.max_gem_colours <= len(COLOURS):
            raise ValueError(f"max_gem_colours must be in [0, {len(COLOURS)}]")
        if not 0.0 <= self.noise <= 0.3:
            raise ValueError("noise must be in [0, 0.3]")
        if not 0.0 <= self.busy <= 2.0:
            raise ValueError(f"busy must be in [0, 2] (0: a plain ground), got {self.busy}")

    @property
    def image_size(self) -> int:
        return self.grid * self.cell


DEFAULT_CONFIG = GridConfig()


@dataclass
class Obj:
    """One rectangle of tokens: rows ``top..top+h-1``, columns ``left..left+w-1``."""

    colour: int
    texture: int
    top: int
    left: int
    h: int
    w: int

    def cells(self) -> list[tuple[int, int]]:
        return [
            (r, c)
            for r in range(self.top, self.top + self.h)
            for c in range(self.left, self.left + self.w)
        ]

    @property
    def centre(self) -> tuple[float, float]:
        return self.top + (self.h - 1) / 2, self.left + (self.w - 1) / 2


@dataclass
class Scene:
    """The layout of one image (what `render_image` draws)."""

    size: int
    split_axis: int
    """0: ground regions above/below ``split_at``; 1: left/right of it."""
    split_at: int
    materials: tuple[int, int]
    objects: list[Obj]
    gems: list[tuple[int, int, int]]
    """``(row, col, colour)`` of each gem."""
    sign: tuple[int, int, tuple[int, ...]]
    """``(row, col, glyphs)``: the sign's first cell and its three glyphs."""

    def material_at(self, r: int, c: int) -> int:
        return self.materials[int((r if self.split_axis == 0 else c) >= self.split_at)]

    def maps(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(kind, what, how)``, int64 ``[G, G]`` each: per token its kind (0 ground, 1
        object, 2 gem, 3 sign), what it shows (material, colour or glyph index) and how
        (texture index for objects, slot for the sign, 0 otherwise)."""
        g = self.size
        line = torch.arange(g)
        side = (line[:, None] if self.split_axis == 0 else line[None, :]).expand(
            g, g
        ) >= self.split_at
        kind = torch.zeros(g, g, dtype=torch.int64)
        what = torch.tensor(self.materials)[side.long()]
        how = torch.zeros(g, g, dtype=torch.int64)
        for ob in self.objects:
            sl = (slice(ob.top, ob.top + ob.h), slice(ob.left, ob.left + ob.w))
            kind[sl], what[sl], how[sl] = 1, ob.colour, ob.texture
        for r, c, k in self.gems:
            kind[r, c], what[r, c] = 2, k
        r, c, glyphs = self.sign
        n = len(glyphs)
        kind[r, c : c + n], what[r, c : c + n], how[r, c : c + n] = (
            3,
            torch.tensor(glyphs),
            torch.arange(n),
        )
        return kind, what, how

    def labels(self) -> torch.Tensor:
        """int64 ``[G, G, 4]``: per token the word ids of `LABEL_GROUPS` (what it shows, its
        kind, its vertical and its horizontal half)."""
        kind, what, how = self.maps()
        g, half = self.size, self.size // 2
        what_id = torch.stack([_table(MATERIALS), _table(COLOURS), _table(COLOURS), _table(GLYPHS)])
        how_id = torch.stack(
            [
                _table(("ground",) * 4),
                _table(TEXTURES),
                _table(("gem",) * 4),
                _table(SLOTS + ("s1",)),
            ]
        )
        line = torch.arange(g)
        vert = _table(VERTICAL)[(line >= half).long()][:, None].expand(g, g)
        horiz = _table(HORIZONTAL)[(line >= half).long()][None, :].expand(g, g)
        return torch.stack([what_id[kind, what], how_id[kind, how], vert, horiz], -1)

    def mask(self, kind: str, index: int | None = None, colour: int | None = None) -> torch.Tensor:
        """bool ``[G, G]``: the tokens of object ``index``, of the gems of ``colour``, or of the
        sign."""
        g = self.size
        m = torch.zeros(g, g, dtype=torch.bool)
        if kind == "object":
            for r, c in self.objects[index].cells():
                m[r, c] = True
        elif kind == "gem":
            for r, c, k in self.gems:
                m[r, c] = m[r, c] or k == colour
        elif kind == "sign":
            r, c, _ = self.sign
            m[r, c : c + len(SLOTS)] = True
        return m


def _table(words: Sequence[str], width: int = 8) -> torch.Tensor:
    """Word ids of ``words``, padded with the first to ``width`` entries (a gather table)."""
    ids = list(_ids(words))
    return torch.tensor(ids + [ids[0]] * (width - len(ids)))


# --------------------------------------------------------------------------- layouts


_SIZES = (1, 2, 3, 4, 5)
_SIZE_WEIGHTS = (0.16, 0.2, 0.22, 0.22, 0.2)


def _free(taken: torch.Tensor, r0: int, c0: int, h: int, w: int, margin: int = 1) -> bool:
    g = taken.shape[0]
    return not bool(
        taken[
            max(0, r0 - margin) : min(g, r0 + h + margin),
            max(0, c0 - margin) : min(g, c0 + w + margin),
        ].any()
    )


def make_layout(rng: random.Random, split: str, config: GridConfig = DEFAULT_CONFIG) -> Scene:
    """Sample one scene: ground, objects, gems and sign (all randomness from ``rng``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    g, half = config.grid, config.grid // 2
    axis = rng.randrange(2)
    split_at = rng.randrange(g // 4, g - g // 4)
    materials = tuple(rng.sample(range(len(MATERIALS)), 2))
    taken = torch.zeros(g, g, dtype=torch.bool)
    objects: list[Obj] = []
    colours = rng.sample(range(len(COLOURS)), rng.randint(config.min_objects, config.max_objects))
    for colour in colours:
        for _ in range(60):
            h, w = (rng.choices(_SIZES, _SIZE_WEIGHTS)[0] for _ in range(2))
            qr, qc = rng.randrange(2) * half, rng.randrange(2) * half
            r0, c0 = qr + rng.randrange(half - h + 1), qc + rng.randrange(half - w + 1)
            if _free(taken, r0, c0, h, w):
                objects.append(Obj(colour, rng.randrange(len(TEXTURES)), r0, c0, h, w))
                taken[r0 : r0 + h, c0 : c0 + w] = True
                break
    # the sign: three cells in a row, clear of objects
    for _ in range(200):
        r0, c0 = rng.randrange(g), rng.randrange(g - len(SLOTS) + 1)
        if _free(taken, r0, c0, 1, len(SLOTS)):
            break
    else:  # pragma: no cover - a 16 x 16 grid always has room
        raise RuntimeError("no room for the sign")
    sign = (r0, c0, tuple(rng.randrange(len(GLYPHS)) for _ in SLOTS))
    taken[r0, c0 : c0 + len(SLOTS)] = True
    gems: list[tuple[int, int, int]] = []
    for colour in rng.sample(range(len(COLOURS)), rng.randint(0, config.max_gem_colours)):
        for _ in range(rng.randint(0, MAX_COUNT)):
            for _ in range(100):
                r, c = rng.randrange(g), rng.randrange(g)
                if _free(taken, r, c, 1, 1):
                    gems.append((r, c, colour))
                    taken[r, c] = True
                    break
    return Scene(g, axis, split_at, materials, objects, gems, sign)


# --------------------------------------------------------------------------- rendering


@lru_cache(maxsize=1)
def _textures() -> torch.Tensor:
    """``[4, 4, 4]`` ink masks of the object textures."""
    y, x = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    return torch.stack(
        [
            torch.ones(4, 4),
            (y % 2 == 0).float(),
            ((y // 2 + x // 2) % 2 == 0).float(),
            ((y % 2 == 0) & (x % 2 == 0)).float(),
        ]
    )


@lru_cache(maxsize=1)
def _gem() -> torch.Tensor:
    m = torch.zeros(4, 4)
    m[1:3, :] = 1
    m[:, 1:3] = 1
    return m


@lru_cache(maxsize=1)
def _glyphs() -> torch.Tensor:
    """``[8, 4, 4]`` fixed glyph bitmaps, pairwise at least 4 pixels apart (seeded once)."""
    gen = random.Random("scenes-glyphs")
    out: list[torch.Tensor] = []
    while len(out) < len(GLYPHS):
        cand = torch.tensor([[float(gen.random() < 0.5) for _ in range(4)] for _ in range(4)])
        if 5 <= cand.sum() <= 10 and all(int((cand != o).sum()) >= 4 for o in out):
            out.append(cand)
    return torch.stack(out)


@lru_cache(maxsize=1)
def _hues() -> torch.Tensor:
    return torch.stack([hue_rgb(k / len(COLOURS)) for k in range(len(COLOURS))])


_MATERIAL_RGB = torch.tensor(
    [[0.10, 0.30, 0.10], [0.34, 0.28, 0.14], [0.08, 0.14, 0.34], [0.24, 0.24, 0.24]]
)
_PLATE_RGB = torch.tensor([[1.0, 0.95, 0.7], [0.7, 0.95, 1.0], [0.95, 0.75, 1.0]])


@lru_cache(maxsize=1)
def _material_patterns() -> torch.Tensor:
    """``[4, 4, 4]`` faint texture of each ground material (field, sand, water, stone)."""
    y, x = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    return torch.stack(
        [(x % 2 == 0).float(), ((x + y) % 3 == 0).float(), (y == 1).float(), torch.zeros(4, 4)]
    )


def render_image(
    rng: random.Random, scene: Scene, config: GridConfig = DEFAULT_CONFIG
) -> torch.Tensor:
    """Draw the ``[3, H, W]`` image of a scene (lighting, ink strength and noise seeded by
    ``rng``)."""
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    g = scene.size
    kind, what, how = scene.maps()
    line = torch.arange(g)
    side = (line[:, None] if scene.split_axis == 0 else line[None, :]).expand(
        g, g
    ) >= scene.split_at
    material = torch.tensor(scene.materials)[side.long()]  # [G, G]
    light = 0.85 + 0.3 * torch.rand(len(MATERIALS), generator=gen)
    ground = (_MATERIAL_RGB[material] * light[material, None])[..., None, None] * (
        1 + 0.35 * _material_patterns()[material]
    )[:, :, None]  # [G, G, 3, 4, 4]
    if config.busy:  # a generator of its own: the rest of the image is drawn as without it
        busy = torch.Generator().manual_seed(rng.getrandbits(63))
        pattern = torch.randint(len(TEXTURES), (g, g), generator=busy)
        ground = ground * (1 + config.busy * _textures()[pattern])[:, :, None]
    hue = _hues()[what.clamp(max=len(COLOURS) - 1)][..., None, None]  # [G, G, 3, 1, 1]
    obj = hue * (0.3 + 0.7 * _textures()[how.clamp(max=len(TEXTURES) - 1)])[:, :, None]
    gem = torch.where(_gem().bool(), hue, ground)
    glyph = _glyphs()[what.clamp(max=len(GLYPHS) - 1)].bool()[:, :, None]  # [G, G, 1, 4, 4]
    plate = _PLATE_RGB[how.clamp(max=len(SLOTS) - 1)][..., None, None].expand(g, g, 3, 4, 4)
    sign = torch.where(glyph, torch.zeros(()), plate)
    k = kind[..., None, None, None]
    tiles = torch.where(k == 0, ground, torch.where(k == 1, obj, torch.where(k == 2, gem, sign)))
    strength = 0.8 + 0.2 * torch.rand(g, g, 1, 1, 1, generator=gen)
    img = (tiles * strength).permute(2, 0, 3, 1, 4).reshape(3, g * 4, g * 4)
    img = img + (torch.rand(img.shape, generator=gen) * 2 - 1) * config.noise
    return img.clamp_(0.0, 1.0)


def sample_image(
    rng: random.Random, split: str, config: GridConfig = DEFAULT_CONFIG
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels [G, G, 4], image)`` of one fresh image (what the trainer's align stage draws)."""
    scene = make_layout(rng, split, config)
    return scene.labels(), render_image(rng, scene, config)
