"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``): anyres-max images, pooled frames.

An image that is the only one of its prompt (``batch_num_images`` 1, or not given) becomes
two grids, one after the other in the prompt:

* the base grid: the whole image resized to one tile, ``side x side`` tokens, no newline;
* the high-resolution grid: all tiles stitched into one map, un-padded to the image's
  aspect ratio and, when it holds more than ``anyres_max_9`` tiles' worth of tokens (ratio
  above 1.1), bilinearly shrunk to ``rows // ratio x cols // ratio``; stored row by row,
  each row followed by one ``image_newline`` token (structural: never merged). E.g. 120,
  152 and 172 tokens for 2 x 3, 3 x 6 and 6 x 6 tiles of a 4 x 4-token tile.

An image among several of one prompt (``batch_num_images`` > 1) is its base grid and one
trailing newline. A video (``pixel_values_videos`` ``[videos, frames, C, H, W]``) is its
frames one after the other, each bilinearly pooled to ``ceil(side / 2)`` squared tokens,
and a single newline after the last frame; every frame is its own segment of the video
(``video=``, ``frame=``), so spatio-temporal partitioners can window across frames.
Trailing newlines are structural tokens of the grid they follow.

The grids come from ``image_sizes`` with the model's own helpers
(``get_anyres_image_grid_shape``, ``unpad_image``, the ``vision_aspect_ratio`` shrink);
``generate()`` encodes images and videos before the prefill and passes
``mm_encoder_outputs`` instead, and then each grid is read from the packed features (the
newline tokens are copies of the model's ``image_newline`` vector).

Exact: anyres-max images (shrunk or not), multi-image prompts, videos, images and videos mixed;
  FlashAttention-2 (2-D padding masks; = the sdpa run under the test stand-in).
Refused: features that are not a ``side x side`` grid per tile (``full`` with a CLS token).
"""

from __future__ import annotations

import dataclasses
import math
from typing import cast

import torch

from ..graph.layout import ImageSegment, TokenKind
from .base import Adapter, place_images
from .llava import _side

__all__ = ["LlavaOnevisionAdapter"]


def check_tile_tokens(adapter: Adapter, strategy: str | None = None) -> None:
    """Refuse a vision tower whose selected features per tile are not the ``side x side``
    grid the model packs (a CLS token kept with ``full``, or a patch dropped with ``default``
    from a tower without CLS)."""
    config = adapter.config
    strategy = strategy or getattr(config, "vision_feature_select_strategy", "default")
    tower = adapter.multimodal_module().vision_tower
    embeddings = getattr(getattr(tower, "vision_model", tower), "embeddings", None)
    positions = getattr(embeddings, "num_positions", None)
    side = _side(config.vision_config)
    if not isinstance(positions, int):
        raise NotImplementedError(
            f"the {adapter.family} adapter cannot tell how many tokens the "
            f"{type(tower).__name__} vision tower gives per tile (no embeddings.num_positions); "
            "use a CLIP or SigLIP tower"
        )
    selected = positions - (1 if strategy == "default" else 0)
    if selected != side * side:
        raise NotImplementedError(
            f"the {adapter.family} adapter needs {side} x {side} = {side * side} features per "
            f"tile, but vision_feature_select_strategy={strategy!r} keeps {selected} of the "
            f"{type(tower).__name__} tower's {positions} tokens; use 'default' for towers with a "
            "CLS token (CLIP), 'full' for towers without (SigLIP)"
        )


def read_anyres_feature(
    feature: torch.Tensor, base: int, newline: torch.Tensor, what: str
) -> tuple[int, int]:
    """``(rows, cols)`` of the newline-terminated part of one packed image feature ``[L, D]``
    after its ``base`` tokens (``(0, 0)`` when there is none; ``cols`` may be 0)."""
    hi = feature[base:]
    if hi.shape[0] == 0:
        return 0, 0
    is_newline = (hi == newline.to(hi.device, hi.dtype)).all(dim=-1)
    rows = int(is_newline.sum())
    if rows == 0 or hi.shape[0] % rows:
        raise ValueError(f"cannot read the grid of a {what} image from its features")
    cols = hi.shape[0] // rows - 1
    expected = torch.zeros(rows, cols + 1, dtype=torch.bool, device=hi.device)
    expected[:, -1] = True
    if not torch.equal(is_newline, expected.flatten()):
        raise ValueError(
            f"the newline tokens of a {what} image feature are not at the end of every row"
        )
    return rows, cols


def with_structural(layout, extras: list[tuple[int, int, int, int]]):
    """``layout`` with the text positions ``(row, start, length, image)`` turned into structural
    tokens of ``image``, at the newline column after its last row (where a
    ``newline_every`` segment keeps its newlines)."""
    if layout is None or not extras:
        return layout
    kind, image, coords = layout.kind.clone(), layout.image.clone(), layout.coords.clone()
    for row, start, length, index in extras:
        h, w = (int(v) for v in layout.image_grid[index])
        span = slice(start, start + length)
        if (kind[row, span] != int(TokenKind.TEXT)).any():
            raise ValueError(
                f"a trailing newline at {start} in row {row} overlaps an image or padding"
            )
        kind[row, span] = int(TokenKind.STRUCTURAL)
        image[row, span] = index
        coords[row, span, 0] = h - 1
        coords[row, span, 1] = w
    return dataclasses.replace(layout, kind=kind, image=image, coords=coords)


def anyres_segments(images, grids, segments: list, extras: list) -> None:
    """Append the segments of anyres images: each a base grid, then (if any) a row-major
    high-resolution grid with a newline after every row. Newlines without a grid (one after
    a lone base tile, or the rows of a degenerate un-pad) go to ``extras`` as
    ``(row, offset, count, segment index)`` for `with_structural`."""
    counts = [b[0] * b[1] + h * (w + 1) for b, (h, w) in grids]
    for (row, offset), (base, (h, w)) in zip(place_images(images, counts), grids):
        segments.append(ImageSegment(row=row, offset=offset, grid=base))
        after = offset + base[0] * base[1]
        if h > 0 and w > 0:
            segments.append(ImageSegment(row=row, offset=after, grid=(h, w), newline_every=w))
        elif h > 0:
            extras.append((row, after, h, len(segments) - 1))


def video_frames(inputs, per_frame: int, trailing: int, newline, what: str) -> list[int]:
    """Frames of every video of the batch, from ``pixel_values_videos`` or the pre-encoded
    ``mm_encoder_outputs["video"]`` (``per_frame`` tokens a frame, ``trailing`` after the last)."""
    pixels = inputs.get("pixel_values_videos")
    encoded = (inputs.get("mm_encoder_outputs") or {}).get("video")
    if encoded is not None:
        frames = []
        for feature in encoded.pooler_output:
            n = feature.shape[0] - trailing
            if n <= 0 or n % per_frame:
                raise ValueError(
                    f"a {what} video feature of {feature.shape[0]} tokens is not frames of "
                    f"{per_frame}"
                )
            if trailing and not bool(
                (feature[-1] == newline.to(feature.device, feature.dtype)).all()
            ):
                raise ValueError(f"a {what} video feature does not end with the model's newline")
            frames.append(n // per_frame)
        return frames
    if pixels is None:
        raise ValueError(
            f"{what} inputs with video tokens need pixel_values_videos (or mm_encoder_outputs)"
        )
    if pixels.dim() != 5:
        raise ValueError(
            "pixel_values_videos must be [videos, frames, C, H, W], "
            f"got shape {tuple(pixels.shape)}"
        )
    return [int(pixels.shape[1])] * int(pixels.shape[0])


def video_segments(placeholders, frames: list[int], grid, trailing: int, first_index: int):
    """Frame segments of every video, and ``with_structural`` extras for its trailing tokens."""
    per_frame = grid[0] * grid[1]
    places = place_images(placeholders, [t * per_frame + trailing for t in frames], "video")
    segments, extras = [], []
    for v, ((row, offset), t) in enumerate(zip(places, frames)):
        segments += [
            ImageSegment(row=row, offset=offset + f * per_frame, grid=grid, video=v, frame=f)
            for f in range(t)
        ]
        if trailing:
            extras.append((row, offset + t * per_frame, trailing, first_index + len(segments) - 1))
    return segments, extras


class LlavaOnevisionAdapter(Adapter):
    """LLaVA-OneVision: base grid + shrunk high-resolution grid with row newlines; pooled frames."""

    family = "llava_onevision"
    model_types = ("llava_onevision",)

    def check_config(self) -> None:
        check_tile_tokens(self)
        self.max_tiles()

    def max_tiles(self) -> int:
        """``N`` of ``vision_aspect_ratio = "anyres_max_N"``, parsed as the model does."""
        ratio = getattr(self.config, "vision_aspect_ratio", "anyres_max_9")
        try:
            return int(ratio.removeprefix("anyres_max_"))
        except (AttributeError, ValueError):
            raise NotImplementedError(
                "the llava_onevision adapter supports vision_aspect_ratio 'anyres_max_<N>', "
                f"got {ratio!r}"
            ) from None

    def image_grids(
        self, image_size, patched: bool = True
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(base grid, high-resolution grid)`` of one image of size ``(height, width)``;
        ``(1, 0)`` for the single trailing newline of an image that is not ``patched``."""
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            get_anyres_image_grid_shape,
            unpad_image,
        )

        side = _side(self.config.vision_config)
        if not patched:
            return (side, side), (1, 0)
        vc = self.config.vision_config
        tile = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
        if isinstance(image_size, torch.Tensor):
            image_size = image_size.tolist()
        image_size = [int(v) for v in image_size]
        tiles_h, tiles_w = get_anyres_image_grid_shape(
            image_size, self.config.image_grid_pinpoints, tile
        )
        rows, cols = unpad_image(torch.empty(0, tiles_h * side, tiles_w * side), image_size).shape[
            1:
        ]
        ratio = math.sqrt(rows * cols / (self.max_tiles() * side**2))
        if ratio > 1.1:  # the model's bilinear shrink, same arithmetic
            rows, cols = int(rows // ratio), int(cols // ratio)
        return (side, side), (int(rows), int(cols))

    def _image_grids(self, inputs) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        side = _side(self.config.vision_config)
        encoded = (inputs.get("mm_encoder_outputs") or {}).get("image")
        if encoded is not None:
            newline = cast(torch.Tensor, self.multimodal_module().image_newline)  # a Parameter [D]
            return [
                ((side, side), read_anyres_feature(f, side * side, newline, "LLaVA-OneVision"))
                for f in encoded.pooler_output
            ]
        sizes = inputs.get("image_sizes")
        if sizes is None:
            raise ValueError(
                "LLaVA-OneVision inputs with image tokens need image_sizes (or mm_encoder_outputs)"
            )
        per_row = inputs.get("batch_num_images")
        if per_row is None:  # the model's default: every image is patched
            patched = [True] * len(sizes)
        else:
            patched = [int(n) == 1 for n in per_row for _ in range(int(n))]
        if len(patched) != len(sizes):
            raise ValueError(
                f"batch_num_images adds up to {len(patched)} images but image_sizes has "
                f"{len(sizes)}"
            )
        return [self.image_grids(size, p) for size, p in zip(sizes, patched)]

    def build_layout(self, inputs, padding):
        input_ids = inputs["input_ids"]
        strategy = inputs.get("vision_feature_select_strategy")
        if strategy is not None:
            check_tile_tokens(self, strategy)
        segments: list[ImageSegment] = []
        extras: list[tuple[int, int, int, int]] = []
        images = input_ids == self.config.image_token_id
        if bool(images.any()):
            grids = self._image_grids(inputs)
            anyres_segments(images, grids, segments, extras)
        videos = input_ids == self.config.video_token_id
        if bool(videos.any()):
            pooled = -(
                -_side(self.config.vision_config) // 2
            )  # the model's ceil(side / 2) bilinear pooling
            newline = self.multimodal_module().image_newline
            frames = video_frames(inputs, pooled * pooled, 1, newline, "LLaVA-OneVision")
            more, more_extras = video_segments(videos, frames, (pooled, pooled), 1, len(segments))
            segments += more
            extras += more_extras
        return with_structural(self.layout_from_segments(input_ids, segments, padding), extras)
