"""InternVL (``InternVLForConditionalGeneration``): one grid per tile.

The processor cuts an image into tiles (plus a thumbnail tile when there are several);
each tile goes through the vision tower on its own and, after the pixel shuffle
(``downsample_ratio``, 0.5: 2x2 patches -> 1 token), becomes a square grid of
``(image_size / patch_size * downsample_ratio)^2`` tokens (16 x 16 = 256 for InternVL2/3).
Each tile is a separate grid in the layout (the thumbnail included): the model gets no
record of how tiles were arranged, so windows never span tile borders.

Exact: identity (nothing removed = unhooked logits, prefill and decode), batch rows alone = in a
  padded batch, sdpa, eager and FlashAttention-2 (2-D padding masks; = the sdpa run under the test
  stand-in), several images (and tiles) per row, beam search.
Refused: nothing family-specific.
"""

from __future__ import annotations

from .base import Adapter

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
        return self.square_tiles_layout(inputs, padding, self.tile_side())
