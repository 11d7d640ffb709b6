"""Tiny random LLaVA-OneVision models (SigLIP tower, Qwen2 decoder) and prompts for them.

An image alone in its prompt is "anyres-max" (base tile + stitched, un-padded tiles with
row newlines, shrunk above ``anyres_max_9``); several images in one prompt are one base
tile and a newline each (``batch_num_images``, as the processor sends it). A video is
``frames`` tiles, each pooled to ``ceil(side / 2)^2`` tokens, and one newline at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightkv.testing.common import (
    IMAGE,
    VIDEO,
    Row,
    _finish,
    _seq,
    _text_config,
    collate_tiles_and_videos,
    text_ids,
)

__all__ = ["build", "collate", "examples", "row", "tokens"]


def build(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    image_size=16,
    patch_size=4,
    max_tiles=6,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    vision_aspect_ratio="anyres_max_9",
):
    """LLaVA-OneVision-shaped: ``(image_size / patch_size)^2`` tokens per tile, tile grids up
    to ``max_tiles x max_tiles`` (the real model's pinpoints, scaled)."""
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        SiglipVisionConfig,
    )

    torch.manual_seed(seed)
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )
    text = _text_config(
        model_type="qwen2",
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
    )
    pinpoints = [
        [image_size * i, image_size * j]
        for i in range(1, max_tiles + 1)
        for j in range(1, max_tiles + 1)
    ]
    cfg = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        image_grid_pinpoints=pinpoints,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=vision_aspect_ratio,
        attn_implementation=attn_implementation,
    )
    return _finish(LlavaOnevisionForConditionalGeneration(cfg), dtype)


def _tiles(model, size) -> int:
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        image_size_to_num_patches,
    )

    cfg = model.config
    return image_size_to_num_patches(
        list(size), cfg.image_grid_pinpoints, cfg.vision_config.image_size
    )


def tokens(model, image_size: tuple[int, int], alone: bool = True) -> int:
    """Placeholder tokens of one image, as the model itself packs it (``alone``: the only
    image of its prompt, so anyres-max; otherwise one base tile and a newline)."""
    side = model.config.vision_config.image_size
    tiles = _tiles(model, image_size) if alone else 1
    pixels = torch.zeros(1, tiles, 3, side, side, dtype=model.dtype, device=model.device)
    with torch.no_grad():
        feats = model.model.get_image_features(
            pixels,
            torch.tensor([list(image_size)], device=model.device),
            batch_num_images=torch.tensor([1 if alone else 2], device=model.device),
        ).pooler_output
    return int(feats[0].shape[0])


def video_tokens(model, frames: int) -> int:
    """Placeholder tokens of a video of ``frames`` frames (pooled frames and one newline)."""
    per_side = -(
        -(model.config.vision_config.image_size // model.config.vision_config.patch_size) // 2
    )
    return frames * per_side * per_side + 1


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
    alone = len(images) == 1
    parts = [text_ids(pre, g)]
    pixels, clips = [], []
    for size in images:
        parts += [torch.full((tokens(model, size, alone),), IMAGE), text_ids(1, g)]
        pixels.append(torch.randn(_tiles(model, size) if alone else 1, 3, side, side, generator=g))
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
    """Left-padded batch: images padded to the most tiles, ``batch_num_images`` per row,
    videos stacked (every video of a batch must have the same number of frames)."""
    out = collate_tiles_and_videos(rows, "LLaVA-OneVision")
    if "pixel_values" in out:
        out["batch_num_images"] = torch.tensor(
            [len(r.images.get("pixel_values", [])) for r in rows]
        )
    return out


def examples(model) -> list[Row]:
    return [
        row(model, [(20, 30)], seed=0),
        row(model, [(30, 18), (16, 16)], videos=[3], pre=2, seed=1),
        row(model, [], seed=2),
        row(model, [(96, 96)], videos=[3, 3], pre=3, seed=3),
    ]
