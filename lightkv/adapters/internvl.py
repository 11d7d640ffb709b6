"""InternVL (``InternVLForConditionalGeneration``): one grid per tile.

The processor cuts an image into tiles (plus a thumbnail tile when there are several);
each tile goes through the vision tower on its own and, after the pixel shuffle
(``downsample_ratio``, 0.5: 2x2 patches -> 1 token), becomes a square grid of
``(image_size / patch_size * downsample_ratio)^2`` tokens (16 x 16 = 256 for InternVL2/3).
Each tile is a separate grid in the layout (the thumbnail included): the model gets no
record of how tiles were arranged, so windows never span tile borders.

Exact: identity (nothing removed = unhooked logits, prefill and decode), batch rows alone = in a padded batch, sdpa and eager, several images (and tiles) per row, beam search.
Refused: nothing family-specific.
"""

from __future__ import annotations

from ..graph.layout import ImageSegment
from .base import Adapter, place_images

__all__ = ["InternVLAdapter"]


def _first(v) -> int:
    return int(v[0] if isinstance(v, (list, tuple)) else v)


class InternVLAdapter(Adapter):
    """InternVL: a ``side x side`` grid per tile after the pixel shuffle."""

    family = "internvl"
    model_types = ("internvl",)

    def check_config(self) -> None:
        self.require_default_feature_strategy()

    def tile_side(self) -> int:
        """Tokens per tile side after the pixel shuffle."""
        vc = self.config.vision_config
        side = _first(vc.image_size) // _first(vc.patch_size)
        return int(round(side * float(self.config.downsample_ratio)))

    def build_layout(self, inputs, padding):
        input_ids = inputs["input_ids"]
        placeholders = input_ids == self.config.image_token_id
        n = int(placeholders.sum())
        if n == 0:
            return None
        side = self.tile_side()
        per_tile = side * side
        if n % per_tile:
            raise ValueError(f"{n} image tokens is not a multiple of {per_tile} tokens per tile ({side}x{side})")
        places = place_images(placeholders, [per_tile] * (n // per_tile), "tile")
        segments = [ImageSegment(row=r, offset=o, grid=(side, side)) for r, o in places]
        return self.layout_from_segments(input_ids, segments, padding)
