"""Photos-VQA pixels: real photographs as backgrounds, with objects, dots and a sign drawn on
them.

Backgrounds are the photographs that ship inside packages the laboratory already installs,
one scene category each (`BACKGROUNDS`; licences as their packages state them):

==========  ==========================================  ======================================
category    source                                      licence
==========  ==========================================  ======================================
astronaut   ``skimage.data.astronaut`` (NASA)           public domain
wall        ``skimage.data.brick`` (CC0Textures)        CC0
camera      ``skimage.data.camera`` (Lav Varshney)      CC0
cat         ``skimage.data.chelsea`` (S. van der Walt)  CC0
coffee      ``skimage.data.coffee`` (R. Michetti)       CC0
grass       ``skimage.data.grass`` (CC0Textures)        CC0
gravel      ``skimage.data.gravel`` (CC0Textures)       CC0
sky         ``skimage.data.hubble_deep_field`` (NASA)   public domain
tissue      ``skimage.data.immunohistochemistry``       no known copyright restrictions
retina      ``skimage.data.retina`` (M. Häggström)      CC0
rocket      ``skimage.data.rocket`` (SpaceX)            public domain
temple      scikit-learn ``china.jpg`` (danielbuechele) CC BY 2.0
flower      scikit-learn ``flower.jpg`` (vultilion)     CC BY 2.0
portrait    matplotlib ``grace_hopper.jpg`` (US Navy)   public domain
clock       ``skimage.data.clock`` (S. van der Walt)    public domain
coins       ``skimage.data.coins`` (Brooklyn Museum)    no known copyright restrictions
==========  ==========================================  ======================================

Each image is a random crop (half to all of the photograph's short side, mirrored half of
the time, brightness jittered) resized to 224 px, so the background is redundant the way a
photograph is: large areas of similar, never identical, patches. Objects are drawn with
anti-aliased edges (4x supersampling), shading that darkens towards the edges and a soft
shadow; the sign's letters use Pillow's bundled font (Aileron, CC0).
"""

from __future__ import annotations

import math
import random
from functools import cache, lru_cache

import numpy as np
import torch

__all__ = ["BACKGROUNDS", "IMAGE_SIZE", "RGB", "background", "draw_layout", "shape_mask"]

IMAGE_SIZE = 224
RGB = {
    "red": (0.86, 0.12, 0.10),
    "yellow": (0.96, 0.84, 0.12),
    "green": (0.12, 0.68, 0.22),
    "blue": (0.14, 0.32, 0.92),
    "purple": (0.60, 0.22, 0.78),
    "white": (0.96, 0.96, 0.94),
}
"""Object and dot colours (linear RGB in ``[0, 1]``), by colour word."""


def _skimage(name: str):
    import skimage.data

    return getattr(skimage.data, name)()


def _sklearn(name: str):
    from sklearn.datasets import load_sample_image

    return load_sample_image(name)


def _matplotlib(name: str):
    from matplotlib import cbook
    from PIL import Image

    with cbook.get_sample_data(name) as f:
        return np.asarray(Image.open(f).convert("RGB"))


BACKGROUNDS = {
    "astronaut": (_skimage, "astronaut"),
    "wall": (_skimage, "brick"),
    "camera": (_skimage, "camera"),
    "cat": (_skimage, "chelsea"),
    "coffee": (_skimage, "coffee"),
    "grass": (_skimage, "grass"),
    "gravel": (_skimage, "gravel"),
    "sky": (_skimage, "hubble_deep_field"),
    "tissue": (_skimage, "immunohistochemistry"),
    "retina": (_skimage, "retina"),
    "rocket": (_skimage, "rocket"),
    "temple": (_sklearn, "china.jpg"),
    "flower": (_sklearn, "flower.jpg"),
    "portrait": (_matplotlib, "grace_hopper.jpg"),
    "clock": (_skimage, "clock"),
    "coins": (_skimage, "coins"),
}
"""Scene category -> (loader, name) of its photograph."""


@cache
def _photo(category: str):
    """The photograph of ``category`` as an RGB ``PIL.Image``."""
    from PIL import Image

    loader, name = BACKGROUNDS[category]
    arr = np.asarray(loader(name))
    if arr.ndim == 2:
        arr = np.repeat(arr[..., None], 3, axis=2)
    return Image.fromarray(arr[..., :3].astype(np.uint8))


def background(category: str, crop: tuple[float, float, float], flip: bool) -> np.ndarray:
    """``[224, 224, 3]`` float32 crop of a photograph: ``crop = (side, top, left)`` as
    fractions (side of the short edge; top and left of the free room)."""
    from PIL import Image

    photo = _photo(category)
    w, h = photo.size
    side = max(16, int(round(crop[0] * min(w, h))))
    top, left = int(crop[1] * (h - side)), int(crop[2] * (w - side))
    img = photo.crop((left, top, left + side, top + side))
    if flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    img = img.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC, reducing_gap=2.0)
    return np.asarray(img, dtype=np.float32) / 255.0


_SS = 4  # supersampling of the shape masks


def _polygon(kind: str, c: float, r: float) -> list[list[tuple[float, float]]]:
    if kind == "star":
        pts = []
        for i in range(10):
            rad = r if i % 2 == 0 else 0.45 * r
            a = -math.pi / 2 + i * math.pi / 5
            pts.append((c + rad * math.cos(a), c + rad * math.sin(a)))
        return [pts]
    if kind == "cone":
        return [[(c, c - r), (c + 0.9 * r, c + 0.8 * r), (c - 0.9 * r, c + 0.8 * r)]]
    if kind == "cross":
        a = r / 3
        return [
            [(c - a, c - r), (c + a, c - r), (c + a, c + r), (c - a, c + r)],
            [(c - r, c - a), (c + r, c - a), (c + r, c + a), (c - r, c + a)],
        ]
    raise ValueError(kind)


@lru_cache(maxsize=512)
def shape_mask(kind: str, size: int) -> np.ndarray:
    """``[size, size]`` float32 coverage in ``[0, 1]`` of an object of ``kind``."""
    from PIL import Image, ImageDraw

    big = size * _SS
    img = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(img)
    c, r = big / 2, big / 2 - _SS
    if kind == "ball":
        draw.ellipse((c - r, c - r, c + r, c + r), fill=255)
    elif kind == "box":
        s = 0.86 * r
        draw.rectangle((c - s, c - s, c + s, c + s), fill=255)
    elif kind == "ring":
        draw.ellipse((c - r, c - r, c + r, c + r), fill=255)
        q = 0.5 * r
        draw.ellipse((c - q, c - q, c + q, c + q), fill=0)
    else:
        for poly in _polygon(kind, c, r):
            draw.polygon(poly, fill=255)
    small = img.resize((size, size), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.float32) / 255.0


def _blur(mask: np.ndarray, radius: float) -> np.ndarray:
    from PIL import Image, ImageFilter

    img = Image.fromarray((mask * 255).astype(np.uint8))
    return np.asarray(img.filter(ImageFilter.GaussianBlur(radius)), dtype=np.float32) / 255.0


def _paste(canvas: np.ndarray, alpha: np.ndarray, rgb: np.ndarray, top: int, left: int) -> None:
    """Alpha-blend ``rgb [h, w, 3]`` with coverage ``alpha [h, w]`` at (top, left), clipped."""
    h, w = alpha.shape
    t0, l0 = max(0, top), max(0, left)
    t1, l1 = min(canvas.shape[0], top + h), min(canvas.shape[1], left + w)
    if t1 <= t0 or l1 <= l0:
        return
    a = alpha[t0 - top : t1 - top, l0 - left : l1 - left, None]
    src = rgb[t0 - top : t1 - top, l0 - left : l1 - left]
    canvas[t0:t1, l0:l1] = canvas[t0:t1, l0:l1] * (1 - a) + src * a


def _draw_object(canvas, kind, colour, cx, cy, size, rng: random.Random) -> None:
    mask = shape_mask(kind, size)
    top, left = int(round(cy - size / 2)), int(round(cx - size / 2))
    # a soft shadow below and to the right
    shadow = _blur(mask, max(1.0, size / 14))
    off = max(1, size // 12)
    _paste(canvas, 0.45 * shadow, np.zeros((size, size, 3), np.float32), top + off, left + off)
    # shading: light from the top left, a little texture, darker towards the edges
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(1, size - 1)
    light = 1.08 - 0.35 * (0.5 * yy + 0.5 * xx)
    gen = np.random.default_rng(rng.getrandbits(32))
    grain = gen.uniform(0.94, 1.06, (size, size)).astype(np.float32)
    inner = _blur((mask > 0.99).astype(np.float32), max(0.6, size / 30))
    shade = (light * grain)[..., None] * (0.55 + 0.45 * inner[..., None])
    rgb = np.clip(np.asarray(RGB[colour], np.float32)[None, None] * shade, 0, 1)
    _paste(canvas, mask, rgb, top, left)


def _draw_sign(canvas, x: int, y: int, letters, rng: random.Random) -> None:
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=17)
    w, h = 14 * len(letters) + 8, 24
    plate = Image.new("RGB", (w, h), tuple(int(255 * v) for v in (0.93, 0.9, 0.8)))
    draw = ImageDraw.Draw(plate)
    draw.rectangle((0, 0, w - 1, h - 1), outline=(70, 60, 50), width=1)
    for i, ch in enumerate(letters):
        draw.text((5 + 14 * i, 2), ch, fill=(10, 10, 10), font=font)
    rgb = np.asarray(plate, dtype=np.float32) / 255.0
    rgb = rgb * rng.uniform(0.85, 1.05)
    _paste(canvas, np.ones((h, w), np.float32), np.clip(rgb, 0, 1), y, x)


def draw_layout(layout) -> torch.Tensor:
    """``[3, 224, 224]`` float32 image in ``[0, 1]`` of a `lightkv_lab.tasks.photos.data.Layout`
    (all randomness from ``layout.seed``)."""
    rng = random.Random(layout.seed)
    canvas = background(layout.scene, layout.crop, layout.flip) * layout.brightness
    for ob in layout.objects:
        _draw_object(canvas, ob.kind, ob.colour, ob.x, ob.y, ob.size, rng)
    for d in layout.dots:
        mask = shape_mask("ball", d.size)
        _paste(
            canvas,
            mask,
            np.broadcast_to(np.asarray(RGB[d.colour], np.float32), (d.size, d.size, 3)).copy(),
            int(d.y - d.size / 2),
            int(d.x - d.size / 2),
        )
    if layout.sign is not None:
        x, y, letters = layout.sign
        _draw_sign(canvas, x, y, letters, rng)
    noise = np.asarray(
        np.random.default_rng(rng.getrandbits(32)).normal(0, 0.01, canvas.shape), np.float32
    )
    return torch.from_numpy(np.clip(canvas + noise, 0, 1)).permute(2, 0, 1).contiguous()
