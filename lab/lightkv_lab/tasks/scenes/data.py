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

=========  =======================================  ====================================
qtype      question                                 answer
=========  =======================================  ====================================
texture    what texture is the red object           striped
where      where is the red object                  top left
count      how many red gems                        n2        (0..3)
exists     is there a red gem                       yes | no
read       read the sign                            beta s2 kappa s3 eta
relation   where is the red object the blue object  left      (top | bottom | left | right)
=========  =======================================  ====================================

``relation`` names two objects in side-by-side or stacked quadrants and answers where the
first lies from the second (the quadrant row or column they share decides which word).

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
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lightkv_lab.tasks import batching as _batching
from lightkv_lab.tasks.digitgrid.data import IGNORE_INDEX, to_pil
from lightkv_lab.tasks.scenes.scene import (
    DEFAULT_CONFIG,
    GridConfig,
    Obj,
    Scene,
    make_layout,
    render_image,
    sample_image,
)
from lightkv_lab.tasks.scenes.vocab import (
    ASKED_REGION,
    BOS_ID,
    COLOURS,
    CONTENT_IDS,
    COUNT_WORDS,
    DETAIL_QTYPES,
    EOS_ID,
    GLYPHS,
    HORIZONTAL,
    IMAGE_ID,
    LABEL_GROUPS,
    MATERIALS,
    MAX_COUNT,
    PAD_ID,
    QTYPES,
    SEP_ID,
    SLOTS,
    SPECIAL_TOKENS,
    SPLITS,
    TEMPLATE_WORDS,
    TEXTURES,
    VERTICAL,
    VOCAB,
    WORD_TO_ID,
    decode,
    encode,
)
from lightkv_lab.tasks.stream import EpisodeStream as _Stream

__all__ = [
    "ASKED_REGION",
    "BOS_ID",
    "COLOURS",
    "CONTENT_IDS",
    "COUNT_WORDS",
    "DEFAULT_CONFIG",
    "DETAIL_QTYPES",
    "EOS_ID",
    "GLYPHS",
    "HORIZONTAL",
    "IGNORE_INDEX",
    "IMAGE_ID",
    "LABEL_GROUPS",
    "MATERIALS",
    "MAX_COUNT",
    "PAD_ID",
    "QTYPES",
    "SEP_ID",
    "SLOTS",
    "SPECIAL_TOKENS",
    "SPLITS",
    "TEMPLATE_WORDS",
    "TEXTURES",
    "VERTICAL",
    "VOCAB",
    "WORD_TO_ID",
    "Episode",
    "EpisodeStream",
    "GridConfig",
    "Obj",
    "Scene",
    "collate",
    "collate_prompts",
    "collate_scenes",
    "decode",
    "encode",
    "followup",
    "make_episode",
    "make_layout",
    "make_scene",
    "num_image_tokens",
    "render_image",
    "sample_image",
    "to_pil",
]

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
        return ["where", "is", "the", name, "object"], [
            VERTICAL[int(cr > half)],
            HORIZONTAL[int(cc > half)],
        ]
    if qtype == "relation":
        a, b = (scene.objects[i] for i in meta["pair"])
        qa, qb = _quadrant(scene, a), _quadrant(scene, b)
        word = HORIZONTAL[int(qa[1] > qb[1])] if qa[0] == qb[0] else VERTICAL[int(qa[0] > qb[0])]
        return [
            "where",
            "is",
            "the",
            COLOURS[a.colour],
            "object",
            "the",
            COLOURS[b.colour],
            "object",
        ], [word]
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


def _quadrant(scene: Scene, ob) -> tuple[int, int]:
    half = scene.size // 2
    return int(ob.top >= half), int(ob.left >= half)


def _relation_pairs(scene: Scene) -> list[tuple[int, int]]:
    """Ordered pairs of objects in side-by-side or stacked quadrants (one quadrant index
    differs)."""
    quads = [_quadrant(scene, ob) for ob in scene.objects]
    return [
        (i, j)
        for i in range(len(quads))
        for j in range(len(quads))
        if (quads[i][0] == quads[j][0]) != (quads[i][1] == quads[j][1])
    ]


def _askable(scene: Scene, qtype: str) -> bool:
    """Whether some question of ``qtype`` can be asked of ``scene`` (only ``relation`` can fail)."""
    return qtype != "relation" or bool(_relation_pairs(scene))


def _choose_meta(
    rng: random.Random, scene: Scene, qtype: str, want: bool | None = None
) -> dict | None:
    if qtype == "relation":
        pairs = _relation_pairs(scene)
        if not pairs:
            return None
        i, j = rng.choice(pairs)
        return {
            "object": i,
            "colour": scene.objects[i].colour,
            "pair": (i, j),
            "region": scene.mask("object", i) | scene.mask("object", j),
        }
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
    return Episode(
        image=image, scene=scene, question=q, answer=a, qtype=qtype, split=split, meta=meta
    )


def make_episode(
    rng: random.Random,
    split: str = "train",
    qtype: str | None = None,
    config: GridConfig = DEFAULT_CONFIG,
    *,
    max_tries: int = 1000,
) -> Episode:
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


def make_scene(
    rng: random.Random,
    split: str = "train",
    n_questions: int = 4,
    config: GridConfig = DEFAULT_CONFIG,
    qtypes: Sequence[str] = QTYPES,
    weights: Sequence[float] | None = None,
) -> list[Episode]:
    """``n_questions`` episodes about one image (a conversation; see `collate_scenes`), each of
    a type drawn from ``qtypes`` (uniformly, or in proportion to ``weights``)."""
    if n_questions < 1:
        raise ValueError("n_questions must be >= 1")
    if weights is not None and len(weights) != len(qtypes):
        raise ValueError(f"weights ({len(weights)}) must match qtypes ({len(qtypes)})")
    live = [q for i, q in enumerate(qtypes) if weights is None or weights[i] > 0]
    scene = make_layout(rng, split, config)
    while not any(_askable(scene, q) for q in live):  # e.g. only ``relation``, no such pair
        scene = make_layout(rng, split, config)
    image = render_image(rng, scene, config)
    out: list[Episode] = []
    while len(out) < n_questions:
        qtype = (
            rng.choice(tuple(qtypes)) if weights is None else rng.choices(tuple(qtypes), weights)[0]
        )
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


class EpisodeStream(_Stream):
    """An endless, seed-deterministic stream of Scenes episodes
    (`lightkv_lab.tasks.stream.EpisodeStream`)."""

    task = "scenes"
    QTYPES, SPLITS, DEFAULT_CONFIG = QTYPES, SPLITS, DEFAULT_CONFIG
    sample = staticmethod(make_episode)


# --------------------------------------------------------------------------- batching


def num_image_tokens(config: GridConfig = DEFAULT_CONFIG, patch: int | None = None) -> int:
    """Vision tokens of a Scenes image: one per cell (``patch`` must equal the cell)."""
    if patch is not None and patch != config.cell:
        raise ValueError(
            f"Scenes needs the tower's patch ({patch}) to equal the cell ({config.cell})"
        )
    return config.grid**2


def collate(
    episodes: Sequence[Episode], num_image_tokens: int, *, with_answer: bool = True
) -> dict[str, torch.Tensor]:
    """Batch episodes for a LLaVA-style model (`lightkv_lab.tasks.batching.collate` with this
    vocabulary)."""
    return _batching.collate(episodes, num_image_tokens, with_answer=with_answer, encoder=encode)


def collate_prompts(episodes: Sequence[Episode], num_image_tokens: int) -> dict[str, torch.Tensor]:
    """Prompt-only batch (no answer, no ``labels``); every row's next token is the answer's
    first."""
    return collate(episodes, num_image_tokens, with_answer=False)


def collate_scenes(
    scenes: Sequence[Sequence[Episode]], num_image_tokens: int
) -> dict[str, torch.Tensor]:
    """One row per image: ``<bos> <image>*n <sep> q1 a1 <eos> q2 a2 <eos> ...``."""
    return _batching.collate_scenes(scenes, num_image_tokens, encoder=encode)
