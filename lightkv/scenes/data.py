"""Scenes-VQA: synthetic VQA with the token statistics of natural images.

An image is ``G x G`` tokens (16 x 16 by default) of ``cell`` pixels, one vision token
per cell, as in SymbolGrid; unlike SymbolGrid, most tokens are redundant:

* **Ground.** Two regions split by a horizontal or vertical line, each one of four
  materials (field, sand, water, stone), a dark colour with a faint per-material texture
  repeated in every token: large areas of near-duplicate tokens.
* **Objects.** 2-5 rectangles of 1 x 1 up to 5 x 5 tokens, each inside one quadrant, each a
  distinct colour (6 hues) with a texture (solid, striped, checked, dotted) repeated in all
  of its tokens: a large object is many near-identical tokens, a 1 x 1 object is one.
* **Gems.** Up to 9 single-token gems (a cross in one of the 6 hues) on the ground: fine
  detail that merging with the ground erases.
* **A sign.** Three single-token glyphs (8 kinds) in a row on pale plates whose tint marks
  the slot (first, second, third), read glyph by glyph during decoding.

Questions name what the early layers can find, a colour:

=========  ======================================  ===============================
qtype      question                                answer
=========  ======================================  ===============================
texture    what texture is the red object          striped
where      where is the red object                 top left
count      how many red gems                       n2        (0..3)
exists     is there a red gem                      yes | no
read       read the sign                           beta s2 kappa s3 eta
=========  ======================================  ===============================

``texture`` and ``where`` are coarse on large objects and fine on small ones; ``count``,
``exists`` and ``read`` hinge on single tokens, and ``read`` answers with its second and
third glyph during decoding (after the slot words ``s2`` / ``s3``), from the compressed cache.
`make_scene` packs several questions about one image (the follow-up turn).

Every token has four labels (`LABEL_GROUPS`): what it shows (a colour, a glyph or the
ground's material), its kind (texture, ``gem``, slot word or ``ground``), and its half of
the image vertically and horizontally. The trainer's ``align`` stage maps the projected
token to the sum of those words' embeddings. Each episode records, in ``meta["region"]``,
the tokens of what the question asks about (for relevance measurements).

Splits: ``train`` and ``heldout`` streams use different seeds; held-out layouts, sizes,
noise and sign texts are new; the glyph shapes, hues and textures are shared. Sequences are
``<bos> <image>*n <sep> question [answer <eos>]``, left-padded, with DigitGrid's special-token
ids.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..digitgrid import batching as _batching
from ..digitgrid import data as _dg
from ..digitgrid.data import IGNORE_INDEX, to_pil

__all__ = [
    "BOS_ID", "COLOURS", "CONTENT_IDS", "EOS_ID", "GLYPHS", "IGNORE_INDEX", "IMAGE_ID", "LABEL_GROUPS",
    "MATERIALS", "PAD_ID", "QTYPES", "SEP_ID", "SPECIAL_TOKENS", "TEXTURES", "VOCAB", "WORD_TO_ID",
    "Episode", "EpisodeStream", "GridConfig", "Scene", "collate", "collate_prompts", "collate_scenes",
    "decode", "encode", "followup", "make_episode", "make_layout", "make_scene", "num_image_tokens", "render_image",
    "sample_image", "to_pil",
]

SPLITS = ("train", "heldout")
QTYPES = ("texture", "where", "count", "exists", "read")
DETAIL_QTYPES = ("count", "exists", "read")
"""Question types whose answer hinges on single tokens."""
ASKED_REGION = True
"""Episodes carry ``meta["region"]``: the tokens the answer is read from (see `Episode`)."""

COLOURS = ("red", "yellow", "green", "cyan", "blue", "magenta")
TEXTURES = ("solid", "striped", "checked", "dotted")
MATERIALS = ("field", "sand", "water", "stone")
GLYPHS = ("alpha", "beta", "gamma", "delta", "eta", "theta", "kappa", "sigma")
SLOTS = ("s1", "s2", "s3")
VERTICAL = ("top", "bottom")
HORIZONTAL = ("left", "right")
MAX_COUNT = 3
COUNT_WORDS = tuple(f"n{i}" for i in range(MAX_COUNT + 1))

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<image>", "<sep>")
TEMPLATE_WORDS = ("what", "texture", "is", "the", "object", "where", "how", "many", "gems", "there", "a",
                  "gem", "read", "sign", "yes", "no", "ground")
VOCAB: tuple[str, ...] = (SPECIAL_TOKENS + TEMPLATE_WORDS + COLOURS + TEXTURES + MATERIALS + GLYPHS + SLOTS
                          + VERTICAL + HORIZONTAL + COUNT_WORDS)
"""The fixed word vocabulary; a word's id is its index (special tokens first, DigitGrid's ids)."""
WORD_TO_ID: dict[str, int] = {w: i for i, w in enumerate(VOCAB)}
assert len(WORD_TO_ID) == len(VOCAB), "duplicate word in VOCAB"
PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, SEP_ID = (WORD_TO_ID[t] for t in SPECIAL_TOKENS)
assert (PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, SEP_ID) == (_dg.PAD_ID, _dg.BOS_ID, _dg.EOS_ID, _dg.IMAGE_ID, _dg.SEP_ID)


def _ids(words: Sequence[str]) -> tuple[int, ...]:
    return tuple(WORD_TO_ID[w] for w in words)


LABEL_GROUPS: tuple[tuple[int, ...], ...] = (
    _ids(COLOURS + GLYPHS + MATERIALS),  # what the token shows
    _ids(TEXTURES + ("gem",) + SLOTS + ("ground",)),  # what kind of thing it is part of
    _ids(VERTICAL),
    _ids(HORIZONTAL),
)
"""Word ids of each of a token's four labels (see `Scene.labels`)."""
CONTENT_IDS = LABEL_GROUPS[0]


def encode(words: Sequence[str]) -> list[int]:
    """Word list -> id list. Raises ``KeyError`` naming the first unknown word."""
    try:
        return [WORD_TO_ID[w] for w in words]
    except KeyError as e:
        raise KeyError(f"word {e.args[0]!r} is not in the Scenes vocabulary") from None


def decode(ids: Sequence[int] | torch.Tensor, *, skip_special: bool = False) -> list[str]:
    """Id list (or 1-D tensor) -> word list; ``skip_special`` drops ``<pad>``/``<bos>``/... ."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    words = [VOCAB[i] for i in ids]
    return [w for w in words if w not in SPECIAL_TOKENS] if skip_special else words


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
    asked: tuple[str, ...] = QTYPES
    """Question types evaluation asks; training draws from all of `QTYPES`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "asked", tuple(self.asked))  # JSON gives a list
        if not self.asked or any(q not in QTYPES for q in self.asked):
            raise ValueError(f"asked must be a non-empty subset of {QTYPES}, got {self.asked}")
        if self.grid % 2 or not 10 <= self.grid <= 32:
            raise ValueError(f"grid must be even and in [10, 32] (four quadrants of objects), got {self.grid}")
        if self.cell != 4:
            raise ValueError(f"cell must be 4 pixels (textures and glyphs are drawn on 4x4), got {self.cell}")
        if not 1 <= self.min_objects <= self.max_objects <= len(COLOURS):
            raise ValueError(f"need 1 <= min_objects <= max_objects <= {len(COLOURS)}")
        if not 0 <= self.max_gem_colours <= len(COLOURS):
            raise ValueError(f"max_gem_colours must be in [0, {len(COLOURS)}]")
        if not 0.0 <= self.noise <= 0.3:
            raise ValueError("noise must be in [0, 0.3]")

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
        return [(r, c) for r in range(self.top, self.top + self.h) for c in range(self.left, self.left + self.w)]

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
        side = (line[:, None] if self.split_axis == 0 else line[None, :]).expand(g, g) >= self.split_at
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
        kind[r, c:c + n], what[r, c:c + n], how[r, c:c + n] = 3, torch.tensor(glyphs), torch.arange(n)
        return kind, what, how

    def labels(self) -> torch.Tensor:
        """int64 ``[G, G, 4]``: per token the word ids of `LABEL_GROUPS` (what it shows, its
        kind, its vertical and its horizontal half)."""
        kind, what, how = self.maps()
        g, half = self.size, self.size // 2
        what_id = torch.stack([_table(MATERIALS), _table(COLOURS), _table(COLOURS), _table(GLYPHS)])
        how_id = torch.stack([_table(("ground",) * 4), _table(TEXTURES), _table(("gem",) * 4), _table(SLOTS + ("s1",))])
        line = torch.arange(g)
        vert = _table(VERTICAL)[(line >= half).long()][:, None].expand(g, g)
        horiz = _table(HORIZONTAL)[(line >= half).long()][None, :].expand(g, g)
        return torch.stack([what_id[kind, what], how_id[kind, how], vert, horiz], -1)

    def mask(self, kind: str, index: int | None = None, colour: int | None = None) -> torch.Tensor:
        """bool ``[G, G]``: the tokens of object ``index``, of the gems of ``colour``, or of the sign."""
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
            m[r, c:c + len(SLOTS)] = True
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
    return not bool(taken[max(0, r0 - margin):min(g, r0 + h + margin), max(0, c0 - margin):min(g, c0 + w + margin)].any())


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
                taken[r0:r0 + h, c0:c0 + w] = True
                break
    # the sign: three cells in a row, clear of objects
    for _ in range(200):
        r0, c0 = rng.randrange(g), rng.randrange(g - len(SLOTS) + 1)
        if _free(taken, r0, c0, 1, len(SLOTS)):
            break
    else:  # pragma: no cover - a 16 x 16 grid always has room
        raise RuntimeError("no room for the sign")
    sign = (r0, c0, tuple(rng.randrange(len(GLYPHS)) for _ in SLOTS))
    taken[r0, c0:c0 + len(SLOTS)] = True
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
    return torch.stack([torch.ones(4, 4), (y % 2 == 0).float(), ((y // 2 + x // 2) % 2 == 0).float(),
                        ((y % 2 == 0) & (x % 2 == 0)).float()])


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
    return torch.stack([_dg.hue_rgb(k / len(COLOURS)) for k in range(len(COLOURS))])


_MATERIAL_RGB = torch.tensor([[0.10, 0.30, 0.10], [0.34, 0.28, 0.14], [0.08, 0.14, 0.34], [0.24, 0.24, 0.24]])
_PLATE_RGB = torch.tensor([[1.0, 0.95, 0.7], [0.7, 0.95, 1.0], [0.95, 0.75, 1.0]])


@lru_cache(maxsize=1)
def _material_patterns() -> torch.Tensor:
    """``[4, 4, 4]`` faint texture of each ground material (field, sand, water, stone)."""
    y, x = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    return torch.stack([(x % 2 == 0).float(), ((x + y) % 3 == 0).float(), (y == 1).float(), torch.zeros(4, 4)])


def render_image(rng: random.Random, scene: Scene, config: GridConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Draw the ``[3, H, W]`` image of a scene (lighting, ink strength and noise seeded by ``rng``)."""
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    g = scene.size
    kind, what, how = scene.maps()
    line = torch.arange(g)
    side = (line[:, None] if scene.split_axis == 0 else line[None, :]).expand(g, g) >= scene.split_at
    material = torch.tensor(scene.materials)[side.long()]  # [G, G]
    light = 0.85 + 0.3 * torch.rand(len(MATERIALS), generator=gen)
    ground = (_MATERIAL_RGB[material] * light[material, None])[..., None, None] \
        * (1 + 0.35 * _material_patterns()[material])[:, :, None]  # [G, G, 3, 4, 4]
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


def sample_image(rng: random.Random, split: str, config: GridConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """``(labels [G, G, 4], image)`` of one fresh image (what the trainer's align stage draws)."""
    scene = make_layout(rng, split, config)
    return scene.labels(), render_image(rng, scene, config)


# --------------------------------------------------------------------------- questions


@dataclass
class Episode:
    """One image with one question and its answer."""

    image: torch.Tensor
    """float32 ``[3, H, W]`` in ``[0, 1]``."""
    scene: Scene
    question: list[str]
    answer: list[str]
    qtype: str
    split: str
    meta: dict = field(default_factory=dict)
    """What was asked (``colour`` where one is named) and ``region``, bool ``[G, G]``: the
    tokens the answer is read from (empty for a ``count`` / ``exists`` of an absent colour)."""

    @property
    def grid(self) -> torch.Tensor:
        """``[G, G, 4]`` token labels (see `Scene.labels`)."""
        return self.scene.labels()


def _question_and_answer(scene: Scene, qtype: str, meta: dict) -> tuple[list[str], list[str]]:
    if qtype in ("texture", "where"):
        ob = scene.objects[meta["object"]]
        name = COLOURS[ob.colour]
        if qtype == "texture":
            return ["what", "texture", "is", "the", name, "object"], [TEXTURES[ob.texture]]
        cr, cc = ob.centre
        half = (scene.size - 1) / 2
        return ["where", "is", "the", name, "object"], [VERTICAL[int(cr > half)], HORIZONTAL[int(cc > half)]]
    if qtype in ("count", "exists"):
        n = sum(k == meta["colour"] for _, _, k in scene.gems)
        name = COLOURS[meta["colour"]]
        if qtype == "count":
            return ["how", "many", name, "gems"], [COUNT_WORDS[n]]
        return ["is", "there", "a", name, "gem"], ["yes" if n else "no"]
    if qtype == "read":
        g1, g2, g3 = (GLYPHS[k] for k in scene.sign[2])
        return ["read", "the", "sign"], [g1, "s2", g2, "s3", g3]
    raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")


def _choose_meta(rng: random.Random, scene: Scene, qtype: str, want: bool | None = None) -> dict | None:
    if qtype in ("texture", "where"):
        i = rng.randrange(len(scene.objects))
        return {"object": i, "colour": scene.objects[i].colour, "region": scene.mask("object", i)}
    if qtype in ("count", "exists"):
        present = sorted({k for _, _, k in scene.gems})
        want = (rng.random() < 0.5) if want is None else want
        pool = present if want else [k for k in range(len(COLOURS)) if k not in present]
        if not pool:
            return None
        k = rng.choice(pool)
        return {"colour": k, "region": scene.mask("gem", colour=k)}
    if qtype == "read":
        return {"region": scene.mask("sign")}
    raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")


def _episode(image, scene, qtype, meta, split) -> Episode:
    q, a = _question_and_answer(scene, qtype, meta)
    return Episode(image=image, scene=scene, question=q, answer=a, qtype=qtype, split=split, meta=meta)


def make_episode(rng: random.Random, split: str = "train", qtype: str | None = None,
                 config: GridConfig = DEFAULT_CONFIG, *, max_tries: int = 1000) -> Episode:
    """Sample one episode; ``qtype=None`` picks one of `QTYPES` uniformly. ``count`` and
    ``exists`` ask about a colour with gems half of the time (``exists`` is yes/no 50/50)."""
    if qtype is None:
        qtype = rng.choice(QTYPES)
    elif qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    want = rng.random() < 0.5
    for _ in range(max_tries):
        scene = make_layout(rng, split, config)
        meta = _choose_meta(rng, scene, qtype, want)
        if meta is not None:
            break
    else:  # pragma: no cover
        raise RuntimeError(f"could not sample a {qtype!r} episode in {max_tries} tries")
    return _episode(render_image(rng, scene, config), scene, qtype, meta, split)


def make_scene(rng: random.Random, split: str = "train", n_questions: int = 4,
               config: GridConfig = DEFAULT_CONFIG, qtypes: Sequence[str] = QTYPES) -> list[Episode]:
    """``n_questions`` episodes about one image (a conversation; see `collate_scenes`)."""
    if n_questions < 1:
        raise ValueError("n_questions must be >= 1")
    scene = make_layout(rng, split, config)
    image = render_image(rng, scene, config)
    out: list[Episode] = []
    while len(out) < n_questions:
        qtype = rng.choice(tuple(qtypes))
        meta = _choose_meta(rng, scene, qtype)
        if meta is not None:
            out.append(_episode(image, scene, qtype, meta, split))
    return out


def followup(rng: random.Random, ep: Episode, config: GridConfig = DEFAULT_CONFIG) -> Episode:
    """A second question about the same image, asked after ``ep``'s answer: the texture of
    another object than the one ``ep`` asked about (any object after a gem or sign question)."""
    others = [i for i in range(len(ep.scene.objects)) if i != ep.meta.get("object")]
    i = rng.choice(others or [0])
    meta = {"object": i, "colour": ep.scene.objects[i].colour, "region": ep.scene.mask("object", i)}
    return _episode(ep.image, ep.scene, "texture", meta, ep.split)


class EpisodeStream:
    """An endless, seed-deterministic stream of episodes."""

    def __init__(self, seed: int, split: str = "train", *, qtypes: Sequence[str] | None = None,
                 config: GridConfig = DEFAULT_CONFIG) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        qtypes = tuple(QTYPES if qtypes is None else qtypes)
        if not qtypes or any(q not in QTYPES for q in qtypes):
            raise ValueError(f"qtypes must be a non-empty subset of {QTYPES}, got {qtypes}")
        self.split, self.qtypes, self.config = split, qtypes, config
        self._rng = random.Random(f"scenes:{seed}:{split}")

    def __iter__(self) -> Iterator[Episode]:
        return self

    def __next__(self) -> Episode:
        return make_episode(self._rng, self.split, self._rng.choice(self.qtypes), self.config)

    def take(self, n: int) -> list[Episode]:
        return [next(self) for _ in range(n)]


# --------------------------------------------------------------------------- batching


def num_image_tokens(config: GridConfig = DEFAULT_CONFIG, patch: int | None = None) -> int:
    """Vision tokens of a Scenes image: one per cell (``patch`` must equal the cell)."""
    if patch is not None and patch != config.cell:
        raise ValueError(f"Scenes needs the tower's patch ({patch}) to equal the cell ({config.cell})")
    return config.grid**2


def collate(episodes: Sequence[Episode], num_image_tokens: int, *, with_answer: bool = True) -> dict[str, torch.Tensor]:
    """Batch episodes for a LLaVA-style model (`lightkv.digitgrid.batching.collate` with this vocabulary)."""
    return _batching.collate(episodes, num_image_tokens, with_answer=with_answer, encoder=encode)


def collate_prompts(episodes: Sequence[Episode], num_image_tokens: int) -> dict[str, torch.Tensor]:
    """Prompt-only batch (no answer, no ``labels``); every row's next token is the answer's first."""
    return collate(episodes, num_image_tokens, with_answer=False)


def collate_scenes(scenes: Sequence[Sequence[Episode]], num_image_tokens: int) -> dict[str, torch.Tensor]:
    """One row per image: ``<bos> <image>*n <sep> q1 a1 <eos> q2 a2 <eos> ...``."""
    return _batching.collate_scenes(scenes, num_image_tokens, encoder=encode)
