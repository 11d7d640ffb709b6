"""LLaVA-NeXT-Video (``LlavaNextVideoForConditionalGeneration``): anyres images, pooled frames.

Images are laid out as LLaVA-NeXT lays them out: the base grid (``side x side`` tokens),
then the tiles stitched and un-padded to the image's aspect ratio, row by row, each row
followed by one ``image_newline`` token (structural: never merged). A video
(``pixel_values_videos`` ``[videos, frames, C, H, W]``) is its frames concatenated, each
pooled by the ``vision_resampler`` (``spatial_pool_mode`` average / max / conv, kernel and
stride ``spatial_pool_stride``) to ``side // stride`` squared tokens, with no newline at
all; every frame is its own segment of the video (``video=``, ``frame=``), so
spatio-temporal partitioners can window across frames.

The grids come from ``image_sizes`` with the model's own helpers
(``get_anyres_image_grid_shape``, ``unpad_image``) and from the shape of
``pixel_values_videos``; ``generate()`` encodes both before the prefill and passes
``mm_encoder_outputs`` instead, and then the image grids are read from the packed features
(newlines are copies of ``image_newline``) and each video's frame count from its length.

Exact: anyres images (degenerate un-pads included), videos, images and videos mixed in one batch;
  FlashAttention-2 (2-D padding masks; = the sdpa run under the test stand-in).
Refused: features that are not a ``side x side`` grid per tile (``full`` with a CLS token).
"""

from __future__ import annotations

from ..graph.layout import ImageSegment
from .base import Adapter
from .llava import _side
from .llava_next import LlavaNextAdapter
from .llava_onevision import (
    anyres_segments,
    check_tile_tokens,
    read_anyres_feature,
    video_frames,
    video_segments,
    with_structural,
)

__all__ = ["LlavaNextVideoAdapter"]


class LlavaNextVideoAdapter(Adapter):
    """LLaVA-NeXT-Video: LLaVA-NeXT's image grids; pooled video frames without newlines."""

    family = "llava_next_video"
    model_types = ("llava_next_video",)

    def check_config(self) -> None:
        check_tile_tokens(self)
        stride = int(getattr(self.config, "spatial_pool_stride", 2))
        if stride < 1 or _side(self.config.vision_config) < stride:
            raise NotImplementedError(
                "the llava_next_video adapter needs 1 <= spatial_pool_stride <= the tile side, "
                f"got {stride}"
            )

    def image_grids(self, image_size) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(base grid, high-resolution grid)`` of one image: LLaVA-NeXT's anyres rule."""
        # LLaVA-NeXT's rule, borrowed: it reads only self.config, which both families share
        return LlavaNextAdapter.image_grids(self, image_size)  # type: ignore[arg-type]

    def frame_grid(self) -> tuple[int, int]:
        """``(rows, cols)`` of one pooled video frame: ``side // spatial_pool_stride`` (the
        pooling kernel equals its stride, for average, max and conv alike)."""
        pooled = _side(self.config.vision_config) // int(self.config.spatial_pool_stride)
        return pooled, pooled

    def build_layout(self, inputs, padding):
        input_ids = inputs["input_ids"]
        strategy = inputs.get("vision_feature_select_strategy")
        if strategy is not None:
            check_tile_tokens(self, strategy)
        side = _side(self.config.vision_config)
        segments: list[ImageSegment] = []
        extras: list[tuple[int, int, int, int]] = []
        images = input_ids == self.config.image_token_id
        if bool(images.any()):
            encoded = (inputs.get("mm_encoder_outputs") or {}).get("image")
            if encoded is not None:
                newline = self.multimodal_module().image_newline
                grids = [
                    ((side, side), read_anyres_feature(f, side * side, newline, "LLaVA-NeXT-Video"))
                    for f in encoded.pooler_output
                ]
            elif inputs.get("image_sizes") is not None:
                grids = [self.image_grids(size) for size in inputs["image_sizes"]]
            else:
                raise ValueError(
                    "LLaVA-NeXT-Video inputs with image tokens need image_sizes "
                    "(or mm_encoder_outputs)"
                )
            anyres_segments(images, grids, segments, extras)
        videos = input_ids == self.config.video_token_id
        if bool(videos.any()):
            grid = self.frame_grid()
            frames = video_frames(inputs, grid[0] * grid[1], 0, None, "LLaVA-NeXT-Video")
            more, _ = video_segments(videos, frames, grid, 0, len(segments))
            segments += more
        return with_structural(self.layout_from_segments(input_ids, segments, padding), extras)
