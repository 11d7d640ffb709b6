"""Tiny random Qwen2.5-VL models (windowed vision tower, M-RoPE decoder) and prompts with
images and videos for them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from lightkv.testing.common import (
    IMAGE,
    VIDEO,
    VISION_END,
    VISION_START,
    Row,
    _batch_ids,
    _finish,
    _seq,
    _text_config,
    left_pad,
    text_ids,
)


def build_qwen2_5_vl(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    patch_size=2,
):
    """Qwen2.5-VL-shaped: 1-block vision tower (``patch_size`` px patches, 2x2 merge), 3-D M-RoPE
    decoder."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    head_dim = hidden_size // num_heads
    hw = (head_dim // 2) * 3 // 8  # Qwen2.5-VL's 16/24/24 split of the rotary half, scaled
    section = [head_dim // 2 - 2 * hw, hw, hw]
    text = _text_config(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=4 * patch_size,
        out_hidden_size=hidden_size,
        fullatt_block_indexes=[0],
    )
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        attn_implementation=attn_implementation,
    )
    return _finish(Qwen2_5_VLForConditionalGeneration(cfg), dtype)


def row_qwen2_5_vl(
    model,
    images: Sequence[tuple[int, int, int]] | int = ((1, 8, 12),),
    videos: Sequence[tuple[int, int, int]] = (),
    pre: int = 4,
    post: int = 5,
    seed: int = 0,
) -> Row:
    """Images and videos given as ``grid_thw`` (patches; ``h``, ``w`` even), each wrapped in
    vision start/end tokens, with ``mm_token_type_ids`` (1 image, 2 video)."""
    if isinstance(images, int):
        images = [(1, 8, 12)] * images
    g = torch.Generator().manual_seed(seed)
    vc = model.config.vision_config
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    merge = vc.spatial_merge_size**2
    parts, types = [text_ids(pre, g)], [torch.zeros(pre, dtype=torch.long)]
    out: dict[str, Any] = {}
    for key, token, kind, grids in (("image", IMAGE, 1, images), ("video", VIDEO, 2, videos)):
        pix = []
        for t, h, w in grids:
            n = t * h * w // merge
            parts += [
                torch.tensor([VISION_START]),
                torch.full((n,), token),
                torch.tensor([VISION_END]),
                text_ids(1, g),
            ]
            types += [
                torch.zeros(1, dtype=torch.long),
                torch.full((n,), kind),
                torch.zeros(2, dtype=torch.long),
            ]
            pix.append(torch.randn(t * h * w, dim, generator=g))
        if grids:
            prefix = "pixel_values" if key == "image" else "pixel_values_videos"
            out[prefix] = torch.cat(pix)
            out[f"{key}_grid_thw"] = torch.tensor([list(x) for x in grids])
    parts.append(text_ids(post, g))
    types.append(torch.zeros(post, dtype=torch.long))
    return Row(_seq(*parts), out, torch.cat(types))


def collate_qwen2_5_vl(rows: Sequence[Row]) -> dict:
    out = _batch_ids(rows)
    types, _ = left_pad([cast(torch.Tensor, r.mm_token_type_ids) for r in rows])  # row() sets them
    out["mm_token_type_ids"] = types
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [r.images[key] for r in rows if key in r.images]
        if parts:
            out[key] = torch.cat(parts)
    return out


def examples_qwen2_5_vl(model) -> list[Row]:
    return [
        row_qwen2_5_vl(model, [(1, 8, 12)], seed=0),
        row_qwen2_5_vl(model, [(1, 12, 8)], videos=[(2, 8, 8)], pre=2, seed=1),
        row_qwen2_5_vl(model, [], seed=2),
    ]
