"""Tiny random LLaVA-NeXT-Video models (CLIP tower, LLaMA decoder) and prompts for them.

Images are LLaVA-NeXT's (base tile + un-padded tiles with row newlines); a video is
``frames`` tiles, each average-pooled to ``(side // 2)^2`` tokens, concatenated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightkv.testing.common import (
    IMAGE,
    VIDEO,
    Row,
    _clip_llama_configs,
    _finish,
    _seq,
    collate_tiles_and_videos,
    text_ids,
)

__all__ = ["build", "collate", "examples", "row", "tokens", "video_tokens"]


def build(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    image_size=16,
    patch_size=4,
    pinpoints=((16, 32), (32, 16), (32, 32)),
    spatial_pool_mode="average",
    spatial_pool_stride=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
):
    """LLaVA-NeXT-Video-shaped: ``(image_size / patch_size)^2`` base tokens per image, tiles
    from ``pinpoints``; video frames pooled by ``spatial_pool_stride``."""
    from transformers import (
        LlavaNextVideoConfig,
        LlavaNextVideoForConditionalGeneration,
    )

    torch.manual_seed(seed)
    vision, text = _clip_llama_configs(
        image_size, patch_size, num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads
    )
    cfg = LlavaNextVideoConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        image_grid_pinpoints=[list(p) for p in pinpoints],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        spatial_pool_mode=spatial_pool_mode,
        spatial_pool_stride=spatial_pool_stride,
        attn_implementation=attn_implementation,
    )
    model = LlavaNextVideoForConditionalGeneration(cfg)
    with torch.no_grad():  # give the newline embedding values of its own
        model.model.image_newline.normal_(generator=torch.Generator().manual_seed(seed))
    return _finish(model, dtype)


def _tiles(model, size) -> int:
    from transformers.models.llava_next_video.modeling_llava_next_video import (
        image_size_to_num_patches,
    )

    cfg = model.config
    return image_size_to_num_patches(
        list(size), cfg.image_grid_pinpoints, cfg.vision_config.image_size
    )


def tokens(model, image_size: tuple[int, int]) -> int:
    """Placeholder tokens of one image, as the model itself packs it."""
    side = model.config.vision_config.image_size
    pixels = torch.zeros(
        1, _tiles(model, image_size), 3, side, side, dtype=model.dtype, device=model.device
    )
    with torch.no_grad():
        feats = model.model.get_image_features(
            pixels, torch.tensor([list(image_size)], device=model.device)
        ).pooler_output
    return int(feats[0].shape[0])


def video_tokens(model, frames: int) -> int:
    """Placeholder tokens of a video of ``frames`` frames, as the model itself pools it."""
    side = model.config.vision_config.image_size
    with torch.no_grad():
        feats = model.model.get_video_features(
            torch.zeros(1, frames, 3, side, side, dtype=model.dtype)
        ).pooler_output
    return int(feats.shape[1])


def row(
    model,
    images: Sequence[tuple[int, int]] | int = ((20, 30),),
    videos: Sequence[int] = (),
    pre: int = 4,
    post: int = 5,
    seed: int = 0,
) -> Row:
    """Images as ``(height, width)`` pixels, then videos as frame counts, text around them."""
    if isinstance(images, int):
        images = [(20, 30)] * images
    g = torch.Generator().manual_seed(seed)
    side = model.config.vision_config.image_size
    parts = [text_ids(pre, g)]
    pixels, clips = [], []
    for size in images:
        parts += [torch.full((tokens(model, size),), IMAGE), text_ids(1, g)]
        pixels.append(torch.randn(_tiles(model, size), 3, side, side, generator=g))
    for frames in videos:
        parts += [torch.full((video_tokens(model, frames),), VIDEO), text_ids(1, g)]
        clips.append(torch.randn(frames, 3, side, side, generator=g))
    parts.append(text_ids(post, g))
    out: dict[str, Any] = {}
    if images:
        out.update(pixel_values=pixels, image_sizes=torch.tensor([list(s) for s in images]))
    if videos:
        out["pixel_values_videos"] = clips
    return Row(_seq(*parts), out)


def collate(rows: Sequence[Row]) -> dict:
    """Left-padded batch: images padded to the most tiles, videos stacked (every video of a
    batch must have the same number of frames)."""
    return collate_tiles_and_videos(rows, "LLaVA-NeXT-Video")


def examples(model) -> list[Row]:
    return [
        row(model, [(20, 30)], seed=0),
        row(model, [(30, 18), (16, 16)], videos=[3], pre=2, seed=1),
        row(model, [], seed=2),
        row(model, [], videos=[3, 3], pre=3, seed=3),
    ]
