"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``, "anyres").

Each image becomes two grids, one after the other in the prompt:

* the base grid: the whole image resized to one tile, ``side x side`` tokens;
* the high-resolution grid: the image's tiles stitched together and un-padded to the
  image's aspect ratio, ``rows x cols`` tokens stored row by row, each row followed by
  one ``image_newline`` token (structural: never merged).

The grid shapes come from ``image_sizes`` with the model's own helpers
(``get_anyres_image_grid_shape``, ``unpad_image``), so they match what the model packs.
``generate()`` encodes images before the prefill and passes ``mm_encoder_outputs``
instead of ``image_sizes``; then each image's grid is read from its packed features,
where every row ends with a copy of the model's ``image_newline`` vector.

Exact: identity (nothing removed = unhooked logits, prefill and decode), batch rows alone = in a
  padded batch, sdpa, eager and FlashAttention-2 (2-D padding masks; = the sdpa run under the test
  stand-in), images of different sizes in one batch, beam search.
Refused: ``vision_feature_select_strategy`` other than ``default``.

Extreme aspect ratios (e.g. 8 x 120 pixels) un-pad to a high-resolution grid without rows
or columns: such an image is its base grid alone (and, without columns, its row newlines
stay text-like, outside any grid).

With a pipeline's ``layout: reference`` (the ``lightkv-paper`` preset) the adapter lays
out an image as the authors' code does: its whole anyres sequence (base grid,
high-resolution grid and row newlines, ``base + rows * (cols + 1)`` tokens, e.g. 2,928
for a 672 x 672 image) is one span of vision tokens, newlines included, which the
pseudo-square partitioner re-packs (2928 -> 1465 -> 733 -> 367 at 4/2/1 windows).
"""

from __future__ import annotations

from typing import cast

import torch

from ..graph.layout import ImageSegment
from .base import Adapter, place_images
from .llava import _side

__all__ = ["LlavaNextAdapter"]


class LlavaNextAdapter(Adapter):
    """LLaVA-NeXT: base grid + un-padded high-resolution grid with row newlines."""

    family = "llava_next"
    model_types = ("llava_next",)

    def check_config(self) -> None:
        self.require_default_feature_strategy()

    def image_grids(self, image_size) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(base grid, high-resolution grid)`` of one image of size ``(height, width)``."""
        from transformers.models.llava_next.modeling_llava_next import (
            get_anyres_image_grid_shape,
            unpad_image,
        )

        vc = self.config.vision_config
        tile = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
        side = _side(vc)
        if isinstance(image_size, torch.Tensor):
            image_size = image_size.tolist()
        image_size = [int(v) for v in image_size]
        tiles_h, tiles_w = get_anyres_image_grid_shape(
            image_size, self.config.image_grid_pinpoints, tile
        )
        rows, cols = unpad_image(torch.empty(0, tiles_h * side, tiles_w * side), image_size).shape[
            1:
        ]
        return (side, side), (int(rows), int(cols))

    def grids_from_features(self, feature: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(base grid, high-resolution grid)`` of one packed image feature ``[L, D]``."""
        side = _side(self.config.vision_config)
        newline = cast(torch.Tensor, self.multimodal_module().image_newline)  # a Parameter [D]
        hi = feature[side * side :]
        if hi.shape[0] == 0:  # an extreme aspect ratio un-pads to no rows at all
            return (side, side), (0, 0)
        is_newline = (hi == newline.to(hi.device, hi.dtype)).all(dim=-1)
        rows = int(is_newline.sum())
        if rows == 0 or hi.shape[0] % rows:
            raise ValueError(
                "cannot read the high-resolution grid of a LLaVA-NeXT image from its features"
            )
        cols = hi.shape[0] // rows - 1
        expected = torch.zeros(rows, cols + 1, dtype=torch.bool, device=hi.device)
        expected[:, -1] = True
        if not torch.equal(is_newline, expected.flatten()):
            raise ValueError(
                "the newline tokens of a LLaVA-NeXT image feature are not at the end of every row"
            )
        return (side, side), (rows, cols)

    def build_layout(self, inputs, padding):
        return self._layout(inputs, padding, reference=False)

    def reference_layout(self, inputs, padding):
        """The authors' layout: each image one span, its newlines included (module docstring)."""
        return self._layout(inputs, padding, reference=True)

    def _layout(self, inputs, padding, reference: bool):
        input_ids = inputs["input_ids"]
        if inputs.get("vision_feature_select_strategy") not in (None, "default"):
            raise NotImplementedError(
                "the llava_next adapter supports vision_feature_select_strategy='default' only"
            )
        placeholders = input_ids == self.config.image_token_id
        if not bool(placeholders.any()):
            return None
        sizes = inputs.get("image_sizes")
        encoded = (inputs.get("mm_encoder_outputs") or {}).get("image")
        if sizes is not None:
            grids = [self.image_grids(size) for size in sizes]
        elif encoded is not None:
            grids = [self.grids_from_features(f) for f in encoded.pooler_output]
        else:
            raise ValueError(
                "LLaVA-NeXT inputs with image tokens need image_sizes (or mm_encoder_outputs)"
            )
        counts = [b[0] * b[1] + h * (w + 1) for b, (h, w) in grids]
        segments = []
        for (row, offset), (base, (h, w)), count in zip(
            place_images(placeholders, counts), grids, counts
        ):
            if (
                reference
            ):  # the authors' code: one span, newlines included (see the module docstring)
                segments.append(ImageSegment(row=row, offset=offset, grid=(1, count)))
                continue
            segments.append(ImageSegment(row=row, offset=offset, grid=base))
            if h > 0 and w > 0:
                segments.append(
                    ImageSegment(
                        row=row, offset=offset + base[0] * base[1], grid=(h, w), newline_every=w
                    )
                )
        return self.layout_from_segments(input_ids, segments, padding)
