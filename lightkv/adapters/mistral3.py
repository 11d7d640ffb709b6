"""Mistral3 (``Mistral3ForConditionalGeneration``) and Pixtral-LLaVA
(``LlavaForConditionalGeneration`` with a Pixtral vision tower, e.g. Pixtral-12B): one grid per
image, rows ended by break tokens.

An image of ``image_sizes = (height, width)`` pixels becomes ``(height // d) x (width // d)``
tokens, ``d = patch_size * spatial_merge_size`` (Mistral3: 14 x 2 = 28 px; Pixtral-LLaVA has no
merge, ``d = patch_size``, 16 px), in raster order (the patch merger's ``unfold`` keeps it).
``PixtralProcessor`` writes the grid row by row: ``cols`` ``[IMG]`` placeholders, then
``[IMG_BREAK]`` after every row but the last, which ends with ``[IMG_END]``. The break and
end tokens are structural (never merged), like LLaVA-NeXT's newlines; images of different
sizes have different grids.

The grid is read from the prompt: the placeholders of one image form rows of equal width
separated by exactly one token. ``generate()`` encodes images before the prefill and passes
``mm_encoder_outputs`` instead of ``image_sizes``; then each image's token count comes from
its features, and the rows from the prompt. With ``image_sizes`` the rows are checked
against them; without either (Pixtral-LLaVA called without ``image_sizes``) every image is
the whole ``pixel_values`` tensor, as the tower then encodes it. A prompt without break
tokens (not the processor's layout) is read as one row per image unless ``image_sizes``
give the grid.

Exact: Mistral3 and Pixtral-LLaVA images of any size, several per row, break/end tokens structural;
  FlashAttention-2 (2-D padding masks; = the sdpa run under the test stand-in).
Refused: sliding-window decoders; Pixtral-LLaVA with vision_feature_select_strategy other than
  "full".
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..graph.layout import ImageSegment
from .base import Adapter

__all__ = ["Mistral3Adapter", "PixtralLlavaAdapter"]


def is_pixtral_llava(config) -> bool:
    """True for a LLaVA config whose vision tower is Pixtral (Pixtral-12B)."""
    vision = getattr(config, "vision_config", None)
    return (
        getattr(config, "model_type", None) == "llava"
        and getattr(vision, "model_type", None) == "pixtral"
    )


class Mistral3Adapter(Adapter):
    """Mistral3: a ``(height // 28) x (width // 28)`` grid per image, rows ended by
    ``[IMG_BREAK]``."""

    family = "mistral3"
    model_types: ClassVar[tuple[str, ...]] = ("mistral3",)  # a subclass has none

    def check_config(self) -> None:
        text = self.config.get_text_config()
        if getattr(text, "sliding_window", None) is not None:
            raise NotImplementedError(
                f"the {self.family} adapter does not support sliding-window attention layers "
                f"(text_config.sliding_window={getattr(text, 'sliding_window', None)}); set it to "
                "None"
            )

    def downsample(self) -> int:
        """Pixels per token side: the tower's patch times the patch merger's factor."""
        return int(self.config.vision_config.patch_size) * int(self.config.spatial_merge_size)

    def _counts_and_grids(self, inputs) -> tuple[list[int], list[tuple[int, int] | None]]:
        sizes = inputs.get("image_sizes")
        encoded = (inputs.get("mm_encoder_outputs") or {}).get("image")
        pixels = inputs.get("pixel_values")
        if (
            sizes is None
            and encoded is None
            and isinstance(pixels, torch.Tensor)
            and pixels.dim() == 4
        ):
            sizes = [list(pixels.shape[-2:])] * pixels.shape[
                0
            ]  # the tower then takes every image whole
        if sizes is not None:
            d = self.downsample()
            sizes = sizes.tolist() if isinstance(sizes, torch.Tensor) else [list(s) for s in sizes]
            grids = [(int(h) // d, int(w) // d) for h, w in sizes]
            return [h * w for h, w in grids], list(grids)
        if encoded is not None:
            feats = encoded.pooler_output
            return [int(f.shape[0]) for f in feats], [None] * len(feats)
        raise ValueError(
            f"{self.family} inputs with image tokens need image_sizes (or mm_encoder_outputs)"
        )

    def build_layout(self, inputs, padding):
        input_ids = inputs["input_ids"]
        placeholders = input_ids == self.config.image_token_id
        if not bool(placeholders.any()):
            return None
        counts, grids = self._counts_and_grids(inputs)
        pos = placeholders.nonzero().cpu()
        if sum(counts) != pos.shape[0]:
            raise ValueError(
                f"the prompt has {pos.shape[0]} image placeholder tokens but the image inputs "
                f"describe {sum(counts)} ({len(counts)} image(s) of {counts} tokens)"
            )
        n = input_ids.shape[1]
        segments, start = [], 0
        for k, (count, grid) in enumerate(zip(counts, grids)):
            if count == 0:
                continue
            seg = pos[start : start + count]
            start += count
            row, offset = int(seg[0, 0]), int(seg[0, 1])
            if int(seg[-1, 0]) != row:
                raise ValueError(f"image {k} ({count} tokens) spans two batch rows")
            steps = torch.diff(seg[:, 1])
            gaps = (steps != 1).nonzero().flatten()
            if len(gaps) == 0:  # one row, or a prompt without break tokens
                h, w = grid if grid is not None else (1, count)
                last = offset + count
                end_token = last < n and not bool(placeholders[row, last])
                if h == 1 and end_token:  # "[IMG]" * w + "[IMG_END]"
                    segments.append(
                        ImageSegment(row=row, offset=offset, grid=(1, w), newline_every=w)
                    )
                else:
                    segments.append(ImageSegment(row=row, offset=offset, grid=(h, w)))
                continue
            w = int(gaps[0]) + 1
            h = count // w
            expected = (
                offset + torch.arange(h).repeat_interleave(w) * (w + 1) + torch.arange(w).repeat(h)
            )
            if count % w or not torch.equal(seg[:, 1], expected):
                raise ValueError(
                    f"image {k} ({count} tokens) is not laid out as rows of equal width, each "
                    "followed by one [IMG_BREAK] token (build the prompt with the model's "
                    "processor)"
                )
            if grid is not None and grid != (h, w):
                raise ValueError(
                    f"image {k}: the prompt holds {h} x {w} tokens but image_sizes give {grid}"
                )
            last = offset + h * (w + 1) - 1
            if last >= n or bool(placeholders[row, last]):
                raise ValueError(
                    f"image {k}: its last row of tokens is not followed by an [IMG_END] token"
                )
            segments.append(ImageSegment(row=row, offset=offset, grid=(h, w), newline_every=w))
        return self.layout_from_segments(input_ids, segments, padding)


class PixtralLlavaAdapter(Mistral3Adapter):
    """Pixtral-LLaVA (Pixtral-12B): a ``(height // 16) x (width // 16)`` grid per image, no
    merge."""

    family = "pixtral"
    model_types = ()  # model_type "llava" with a Pixtral tower; detect_family routes it here

    def check_config(self) -> None:
        if not is_pixtral_llava(self.config):
            raise NotImplementedError(
                "the pixtral adapter is for LlavaForConditionalGeneration with a Pixtral vision "
                f"tower (model_type {self.config.model_type!r}, vision tower "
                f"{getattr(getattr(self.config, 'vision_config', None), 'model_type', None)!r})"
            )
        strategy = getattr(self.config, "vision_feature_select_strategy", "full")
        if strategy != "full":
            raise NotImplementedError(
                "the pixtral adapter supports vision_feature_select_strategy='full' (Pixtral has "
                f"no CLS token); this model uses {strategy!r}"
            )
        super().check_config()

    def downsample(self) -> int:
        return int(self.config.vision_config.patch_size)

    def build_layout(self, inputs, padding):
        if inputs.get("vision_feature_select_strategy") not in (None, "full"):
            raise NotImplementedError(
                "the pixtral adapter supports vision_feature_select_strategy='full' only"
            )
        return super().build_layout(inputs, padding)
