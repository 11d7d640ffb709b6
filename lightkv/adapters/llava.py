"""LLaVA-1.5 (``LlavaForConditionalGeneration``): one square grid per image.

Each image becomes ``(image_size / patch_size)^2`` consecutive placeholder tokens
(``config.image_token_id``), filled in raster order (24 x 24 = 576 for LLaVA-1.5).

Exact: identity (nothing removed = unhooked logits, prefill and decode), batch rows alone = in a
  padded batch, sdpa, eager and FlashAttention-2 (2-D padding masks; = the sdpa run under the test
  stand-in), several images per row, beam search; tower relevance (VisionZip, VisPruner: the CLS
  attention of the CLIP or DINOv2 tower layer `vision_feature_layer` selects, or the mean
  attention of a SigLIP tower), the only family that exposes it.
Refused: ``vision_feature_select_strategy`` other than ``default`` (the CLS token would shift the
  grid).
"""

from __future__ import annotations

from ..graph.layout import ImageSegment
from .base import Adapter, place_images
from .tower import TowerSpec

__all__ = ["LlavaAdapter"]


def _side(vision_config) -> int:
    size, patch = vision_config.image_size, vision_config.patch_size
    size = size[0] if isinstance(size, (list, tuple)) else size
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return int(size) // int(patch)


class LlavaAdapter(Adapter):
    """LLaVA-1.5: a ``side x side`` grid per image, CLS token dropped."""

    family = "llava"
    model_types = ("llava",)

    def check_config(self) -> None:
        if getattr(self.config.vision_config, "model_type", None) == "pixtral":
            raise NotImplementedError(
                "this LLaVA model has a Pixtral vision tower (Pixtral-12B): its images are grids "
                "of any size with [IMG_BREAK] row ends, not LLaVA-1.5 squares; use the 'pixtral' "
                "adapter (detected automatically)"
            )
        self.require_default_feature_strategy()

    def tower_spec(self, layer: int | None = None):
        """The attention of the tower layer ``vision_feature_layer`` selects (hidden state
        ``L + f`` of an ``L``-layer tower for ``f < 0``, so layer ``L + f``; layer ``f - 1``
        for ``f > 0``), or of 0-based tower layer ``layer``; CLIP and DINOv2 towers have a CLS
        token first, SigLIP towers none. CLIP and SigLIP keep their layers in
        ``encoder.layers`` (attention ``self_attn``), DINOv2 in ``encoder.layer`` (attention
        ``attention``)."""
        feature_layer = getattr(self.config, "vision_feature_layer", -2)
        tower = getattr(self.multimodal_module(), "vision_tower", None)
        core = getattr(
            tower, "vision_model", tower
        )  # transformers 5 gives the CLIP/SigLIP model itself
        encoder = getattr(core, "encoder", None)
        layers = getattr(encoder, "layers", None) or getattr(encoder, "layer", None)
        if not isinstance(feature_layer, int) or layers is None:
            raise NotImplementedError(
                "tower relevance needs one vision_feature_layer (an int) and a CLIP/SigLIP/DINOv2-"
                f"style tower (.encoder.layers); this model has {feature_layer!r} and "
                f"{type(tower).__name__}"
            )
        index = len(layers) + feature_layer if feature_layer < 0 else feature_layer - 1
        if not 0 <= index < len(layers):
            raise NotImplementedError(
                f"vision_feature_layer {feature_layer} selects no attention layer of the tower "
                f"({len(layers)} layers): tower relevance cannot be read"
            )
        if layer is not None:
            if not 0 <= layer < len(layers):
                raise IndexError(f"this model's vision tower has layers 0-{len(layers) - 1} only")
            index = layer
        block = layers[index]
        attention = getattr(block, "self_attn", None) or getattr(block, "attention", None)
        if attention is None:
            raise NotImplementedError(
                f"tower layer {index} ({type(block).__name__}) has no self_attn or attention "
                "module: tower relevance cannot be read"
            )
        cls = "siglip" not in str(getattr(self.config.vision_config, "model_type", ""))
        return TowerSpec(attention=attention, cls=cls)

    def build_layout(self, inputs, padding):
        input_ids = inputs["input_ids"]
        if inputs.get("vision_feature_select_strategy") not in (None, "default"):
            raise NotImplementedError(
                "the llava adapter supports vision_feature_select_strategy='default' only"
            )
        placeholders = input_ids == self.config.image_token_id
        n = int(placeholders.sum())
        if n == 0:
            return None
        side = _side(self.config.vision_config)
        per_image = side * side
        if n % per_image:
            raise ValueError(
                f"{n} image tokens is not a multiple of {per_image} tokens per image "
                f"({side}x{side} grid)"
            )
        places = place_images(placeholders, [per_image] * (n // per_image))
        segments = [ImageSegment(row=r, offset=o, grid=(side, side)) for r, o in places]
        return self.layout_from_segments(input_ids, segments, padding)
