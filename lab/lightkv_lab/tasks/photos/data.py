"""Photos-VQA: questions about real photographs with objects, dots and a sign drawn on them.

An image (224 px, 16 x 16 patches of 14 px for the ViT-S/14 tower of
`lightkv_lab.tasks.photos.tower`) is a crop of one of 16 bundled photographs
(`lightkv_lab.tasks.photos.images`) with a big object (76-104 px), one or two medium objects
(40-60 px), a small object (16-22 px, about one patch), 0-4 dots of up to two colours (8-10
px, under a patch) and a three-letter sign. Objects have distinct kinds.

The question mix (`MIX`) follows the eight benchmarks of TOPS's Table 11 (GQA, ScienceQA,
TextVQA, POPE, MME, MMBench, MMBench-CN, MM-Vet): five of them are mostly coarse perception
(POPE is existence yes/no; GQA relations and attributes of whole objects; MMBench and its
Chinese twin and ScienceQA-IMG ask scene, category and attribute questions), TextVQA is
reading, MM-Vet is about one third OCR, and MME mixes existence, position, colour and scene
with count and OCR. So about two thirds coarse and one third fine:

========  ======  ====================================  ====================  ===============
qtype     share   question                              answer                modelled on
========  ======  ====================================  ====================  ===============
exists    20%     is there a star                       yes | no              POPE, MME
scene     10%     what is the background                cat                   MME, MMBench
colour    10%     what colour is the ball               red (big object)      GQA, MMBench
kind      10%     what is the big object                ball                  GQA, MMBench
relation  15%     where is the ball from the star       left|right|above|...  GQA
read      15%     what does the sign say                K E T                 TextVQA, MM-Vet
count     10%     how many blue dots                    zero .. four          MME count
small     10%     what colour is the small cone         green                 GQA, MM-Vet
========  ======  ====================================  ====================  ===============

``exists`` asks about a kind present among the big and medium objects half of the time and
about an absent kind otherwise (POPE's random setting); ``relation`` pairs two of those
objects whose centres differ mostly along one axis (by at least 30 px and 1.3 times the
other axis). Every episode records in ``meta["region"]`` (bool ``[16, 16]``) the patches the
answer is read from (the background's for ``scene``; empty for a count of an absent colour).

Splits: ``train`` and ``heldout`` streams use different seeds (new crops, layouts, colours
and sign texts); the photographs, shapes and font are shared. Sequences are
``<bos> <image>*256 <sep> question [answer <eos>]``, left-padded, with DigitGrid's ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lightkv_lab.tasks import batching as _batching
from lightkv_lab.tasks.digitgrid.data import IGNORE_INDEX, to_pil
from lightkv_lab.tasks.photos.layout import (
    DEFAULT_CONFIG,
    MIX_QTYPES,
    SIDE,
    Dot,
    GridConfig,
    Layout,
    Obj,
    make_layout,
    patches,
    render_image,
    sample_image,
    sign_patches,
)
from lightkv_lab.tasks.photos.tower import IMAGE_MEAN, IMAGE_STD, PATCH
from lightkv_lab.tasks.photos.vocab import *  # noqa: F403 (the vocabulary is part of this module)
from lightkv_lab.tasks.photos.vocab import (
    COLOURS,
    COUNT_WORDS,
    FINE_QTYPES,
    KINDS,
    QTYPES,
    SPLITS,
    encode,
)
from lightkv_lab.tasks.photos.vocab import __all__ as _vocab_all
from lightkv_lab.tasks.stream import EpisodeStream as _Stream

__all__ = [
    *_vocab_all,
    "ASKED_REGION",
    "DETAIL_QTYPES",
    "DEFAULT_CONFIG",
    "IGNORE_INDEX",
    "MIX_QTYPES",
    "Dot",
    "Episode",
    "EpisodeStream",
    "GridConfig",
    "Layout",
    "Obj",
    "collate",
    "collate_prompts",
    "collate_scenes",
    "episodes_for",
    "followup",
    "make_episode",
    "make_layout",
    "make_scene",
    "normalise",
    "num_image_tokens",
    "render_image",
    "sample_image",
    "to_pil",
]

ASKED_REGION = True
"""Episodes carry ``meta["region"]``: the patches the answer is read from."""
DETAIL_QTYPES = FINE_QTYPES
"""Question types whose answer hinges on a few patches (the quality benchmark's detail)."""


# --------------------------------------------------------------------------- questions


@dataclass
class Episode:
    """One image with one question and its answer."""

    image: torch.Tensor | None
    """float32 ``[3, 224, 224]`` in ``[0, 1]`` (None where training reads cached features)."""
    scene: Layout
    question: list[str]
    answer: list[str]
    qtype: str
    split: str
    meta: dict = field(default_factory=dict)
    """``region`` (bool ``[16, 16]``: the patches the answer is read from) and what was asked."""


def _relation(a: Obj, b: Obj) -> str | None:
    dx, dy = a.x - b.x, a.y - b.y
    if abs(dx) >= max(30, 1.3 * abs(dy)):
        return "left" if dx < 0 else "right"
    if abs(dy) >= max(30, 1.3 * abs(dx)):
        return "above" if dy < 0 else "below"
    return None


def _ask(rng: random.Random, layout: Layout, qtype: str, want: bool | None = None):
    """``(question, answer, meta)`` of a ``qtype`` question, or None when none can be asked."""
    want = rng.random() < 0.5 if want is None else want
    big = layout.role("big")[0]
    shown = [o for o in layout.objects if o.role != "small"]
    if qtype == "exists":
        absent = [k for k in KINDS if all(o.kind != k for o in layout.objects)]
        if want or not absent:
            ob = rng.choice(shown)
            return ["is", "there", "a", ob.kind], ["yes"], {"region": patches(layout, [ob])}
        kind = rng.choice(absent)
        return (
            ["is", "there", "a", kind],
            ["no"],
            {"region": torch.zeros(SIDE, SIDE, dtype=torch.bool)},
        )
    if qtype == "scene":
        region = ~patches(layout, layout.objects, layout.dots) & ~sign_patches(layout)
        return ["what", "is", "the", "background"], [layout.scene], {"region": region}
    if qtype == "colour":
        q = ["what", "colour", "is", "the", big.kind]
        return q, [big.colour], {"region": patches(layout, [big])}
    if qtype == "kind":
        return (
            ["what", "is", "the", "big", "object"],
            [big.kind],
            {"region": patches(layout, [big])},
        )
    if qtype == "relation":
        pairs = [(a, b) for a in shown for b in shown if a is not b and _relation(a, b)]
        if not pairs:
            return None
        a, b = rng.choice(pairs)
        q = ["where", "is", "the", a.kind, "from", "the", b.kind]
        return q, [_relation(a, b)], {"region": patches(layout, [a, b])}
    if qtype == "read":
        q = ["what", "does", "the", "sign", "say"]
        return q, list(layout.sign[2]), {"region": sign_patches(layout)}
    if qtype == "count":
        present = sorted({d.colour for d in layout.dots})
        absent = [c for c in COLOURS if c not in present]
        colour = rng.choice(present if (want and present) or not absent else absent)
        dots = [d for d in layout.dots if d.colour == colour]
        q = ["how", "many", colour, "dots"]
        return q, [COUNT_WORDS[len(dots)]], {"region": patches(layout, dots=dots)}
    if qtype == "small":
        ob = layout.role("small")[0]
        q = ["what", "colour", "is", "the", "small", ob.kind]
        return q, [ob.colour], {"region": patches(layout, [ob])}
    raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")


def episodes_for(
    rng: random.Random,
    layout: Layout,
    n: int,
    qtypes: Sequence[str] = QTYPES,
    weights: Sequence[float] | None = None,
    image: torch.Tensor | None = None,
    split: str = "train",
) -> list[Episode]:
    """``n`` questions about one layout, types drawn from ``qtypes`` (uniformly or by
    ``weights``); a type that cannot be asked of it is drawn again."""
    out: list[Episode] = []
    for _ in range(100 * n):
        if len(out) == n:
            break
        qtype = rng.choice(tuple(qtypes)) if weights is None else rng.choices(qtypes, weights)[0]
        asked = _ask(rng, layout, qtype)
        if asked is not None:
            out.append(Episode(image, layout, asked[0], asked[1], qtype, split, asked[2]))
    if len(out) < n:
        raise ValueError(f"none of {tuple(qtypes)} can be asked about this image")
    return out


def make_episode(
    rng: random.Random,
    split: str = "train",
    qtype: str | None = None,
    config: GridConfig = DEFAULT_CONFIG,
) -> Episode:
    """One fresh image and one question (``qtype=None``: drawn by `MIX`)."""
    qtype = rng.choice(MIX_QTYPES) if qtype is None else qtype
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {QTYPES}, got {qtype!r}")
    want = rng.random() < 0.5
    while True:
        layout = make_layout(rng, split, config)
        asked = _ask(rng, layout, qtype, want)
        if asked is not None:
            return Episode(render_image(layout), layout, asked[0], asked[1], qtype, split, asked[2])


def make_scene(
    rng: random.Random,
    split: str = "train",
    n_questions: int = 4,
    config: GridConfig = DEFAULT_CONFIG,
    qtypes: Sequence[str] = QTYPES,
    weights: Sequence[float] | None = None,
) -> list[Episode]:
    """``n_questions`` episodes about one fresh image (see `collate_scenes`)."""
    layout = make_layout(rng, split, config)
    return episodes_for(rng, layout, n_questions, qtypes, weights, render_image(layout), split)


def followup(rng: random.Random, ep: Episode, config: GridConfig = DEFAULT_CONFIG) -> Episode:
    """A second question about ``ep``'s image, asked after its answer: a type drawn by `MIX`
    other than ``ep``'s (the quality benchmark's follow-up turn)."""
    others = tuple(q for q in MIX_QTYPES if q != ep.qtype)
    (second,) = episodes_for(rng, ep.scene, 1, others, image=ep.image, split=ep.split)
    return second


class EpisodeStream(_Stream):
    """An endless, seed-deterministic stream of Photos episodes (types drawn by `MIX`)."""

    task = "photos"
    QTYPES, SPLITS, DEFAULT_CONFIG = QTYPES, SPLITS, DEFAULT_CONFIG
    sample = staticmethod(make_episode)


# --------------------------------------------------------------------------- batching


def num_image_tokens(config: GridConfig = DEFAULT_CONFIG, patch: int | None = None) -> int:
    """Vision tokens of a Photos image (256: 16 x 16 patches of 14 px)."""
    if patch is not None and patch != PATCH:
        raise ValueError(f"Photos needs the tower's patch ({patch}) to be {PATCH}")
    return config.grid**2


def normalise(images: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` in ``[0, 1]`` -> the tower's input (ImageNet mean and std)."""
    mean = torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGE_STD).view(1, 3, 1, 1)
    return (images - mean) / std


def collate(episodes, num_image_tokens: int, *, with_answer: bool = True):
    """`lightkv_lab.tasks.batching.collate` with this vocabulary; pixels normalised."""
    batch = _batching.collate(episodes, num_image_tokens, with_answer=with_answer, encoder=encode)
    batch["pixel_values"] = normalise(batch["pixel_values"])
    return batch


def collate_prompts(episodes, num_image_tokens: int):
    """Prompt-only batch; every row's next token is the answer's first."""
    return collate(episodes, num_image_tokens, with_answer=False)


def collate_scenes(scenes, num_image_tokens: int):
    """One row per image: ``<bos> <image>*n <sep> q1 a1 <eos> q2 a2 <eos> ...``."""
    batch = _batching.collate_scenes(scenes, num_image_tokens, encoder=encode)
    batch["pixel_values"] = normalise(batch["pixel_values"])
    return batch
