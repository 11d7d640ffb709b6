"""Idefics3 (``Idefics3ForConditionalGeneration``) and SmolVLM
(``SmolVLMForConditionalGeneration``): one grid per tile and one for the global view.

The processor splits an image into ``rows x cols`` tiles plus a global view (the whole image
resized to one tile; an image that is not split is its global view alone). Each goes through
the vision tower on its own and, after the pixel shuffle (``scale_factor``: 2 for Idefics3, 4
for SmolVLM), becomes ``(image_size / patch_size / scale_factor)^2`` ``<image>`` placeholders
in raster order: 13 x 13 = 169 for Idefics3-8B (364 px, 14 px patches), 8 x 8 = 64 for
SmolVLM (512 px, 16 px patches). In the prompt, tile ``(i, j)`` is
``<fake_token_around_image><row_i_col_j>`` followed by its placeholders, each tile row ends
with ``\\n``, and the global view is ``\\n<fake_token_around_image><global-img>`` + placeholders
+ ``<fake_token_around_image>``. The marker tokens are text (outside every grid, never
merged); every tile and the global view is its own grid, so windows never cross tile
borders. SmolVLM's video frames reach the model as ordinary images (one global view per
frame, timestamps in the text); each frame is its own grid, not labelled as a video.

Exact: Idefics3 and SmolVLM images (split or not), several per row; video frames as still images;
  FlashAttention-2 (2-D padding masks; = the sdpa run under the test stand-in).
Refused: a vision tower whose patch grid does not divide by scale_factor (the model cannot run it).
"""

from __future__ import annotations

from typing import cast

from torch import nn

from .base import Adapter

__all__ = ["Idefics3Adapter"]


class Idefics3Adapter(Adapter):
    """Idefics3 / SmolVLM: a ``side x side`` grid per tile after the pixel shuffle."""

    family = "idefics3"
    model_types = ("idefics3", "smolvlm")

    def multimodal_module(self) -> nn.Module:
        inner = getattr(self.model, "model", None)
        if isinstance(inner, nn.Module) and isinstance(
            getattr(inner, "text_model", None), nn.Module
        ):
            return inner
        if isinstance(getattr(self.model, "text_model", None), nn.Module):
            return self.model
        raise TypeError(
            f"{type(self.model).__name__}: cannot find the multimodal core (expected "
            "`.model.text_model`)"
        )

    def language_model(self) -> nn.Module:
        return cast(nn.Module, self.multimodal_module().text_model)  # checked a Module above

    def check_config(self) -> None:
        vc = self.config.vision_config
        patches, scale = int(vc.image_size) // int(vc.patch_size), int(self.config.scale_factor)
        if patches % scale:
            raise NotImplementedError(
                f"the {self.family} adapter needs the tile's {patches} x {patches} patch grid to "
                f"divide by scale_factor={scale}"
            )

    def tile_side(self) -> int:
        """Tokens per tile side after the pixel shuffle."""
        vc = self.config.vision_config
        return int(vc.image_size) // int(vc.patch_size) // int(self.config.scale_factor)

    def build_layout(self, inputs, padding):
        return self.square_tiles_layout(inputs, padding, self.tile_side())
