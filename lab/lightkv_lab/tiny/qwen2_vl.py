"""Tiny random Qwen2-VL, and prompts with images and videos for it (also used by Qwen3-VL).

A Qwen2-VL prompt wraps each image and each video in vision start / end tokens; a video's
frames are one run of video placeholders. ``frames_apart=True`` lays a video out the
Qwen3-VL way instead: a timestamp (two text tokens) and start / end tokens around every
frame.
"""

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

__all__ = ["build", "collate", "examples", "row"]

Grid = tuple[int, int, int]


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's 16/24/24 split of the rotary half, scaled to ``head_dim``."""
    hw = (head_dim // 2) * 3 // 8
    return [head_dim // 2 - 2 * hw, hw, hw]


def build(
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
    """Qwen2-VL-shaped: 1-block vision tower (``patch_size`` px patches, 2x2 merge), 3-D M-RoPE
    decoder."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": mrope_section(hidden_size // num_heads),
    }
    text = _text_config(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        rope_parameters=rope,
    )
    vision = dict(
        depth=1,
        embed_dim=32,
        hidden_size=hidden_size,
        mlp_ratio=2,
        num_heads=2,
        patch_size=patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    cfg = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        attn_implementation=attn_implementation,
    )
    return _finish(Qwen2VLForConditionalGeneration(cfg), dtype)


def row(
    model,
    images: Sequence[Grid] | int = ((1, 4, 6),),
    videos: Sequence[Grid] = (),
    pre: int = 4,
    post: int = 5,
    seed: int = 0,
    videos_first: bool = False,
    frames_apart: bool = False,
) -> Row:
    """Images and videos given as ``grid_thw`` (patches; ``h``, ``w`` even), with
    ``mm_token_type_ids`` (1 image, 2 video); one text token after each."""
    if isinstance(images, int):
        images = [(1, 4, 6)] * images
    g = torch.Generator().manual_seed(seed)
    vc = model.config.vision_config
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    m2 = vc.spatial_merge_size**2
    parts, types = [text_ids(pre, g)], [torch.zeros(pre, dtype=torch.long)]

    def add(ids: torch.Tensor, kind: int = 0) -> None:
        parts.append(ids)
        types.append(torch.full((ids.shape[0],), kind, dtype=torch.long))

    def wrap(n: int, token: int, kind: int) -> None:
        add(torch.tensor([VISION_START]))
        add(torch.full((n,), token), kind)
        add(torch.tensor([VISION_END]))

    out: dict[str, Any] = {}
    kinds = [("image", IMAGE, 1, images), ("video", VIDEO, 2, videos)]
    for key, token, kind, grids in kinds[::-1] if videos_first else kinds:
        pix = []
        for t, h, w in grids:
            if kind == 2 and frames_apart:
                for _ in range(t):
                    add(text_ids(2, g))  # the frame's timestamp, e.g. "<0.5 seconds>"
                    wrap(h * w // m2, token, kind)
            else:
                wrap(t * h * w // m2, token, kind)
            add(text_ids(1, g))
            pix.append(torch.randn(t * h * w, dim, generator=g))
        if grids:
            out["pixel_values" if key == "image" else "pixel_values_videos"] = torch.cat(pix)
            out[f"{key}_grid_thw"] = torch.tensor([list(x) for x in grids])
    add(text_ids(post, g))
    return Row(_seq(*parts), out, torch.cat(types))


def collate(rows: Sequence[Row]) -> dict:
    """Left-padded batch: ids, mask, ``mm_token_type_ids``, pixels and grids in row order."""
    out = _batch_ids(rows)
    types = [cast(torch.Tensor, r.mm_token_type_ids) for r in rows]  # row() sets them
    out["mm_token_type_ids"], _ = left_pad(types)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        parts = [r.images[key] for r in rows if key in r.images]
        if parts:
            out[key] = torch.cat(parts)
    return out


def examples(model, frames_apart: bool = False, text_seed: int = 2) -> list[Row]:
    """Two images; an image and a 3-frame video; text only (``text_seed``: one whose greedy
    answer has no early end-of-sequence, so every row generates all its tokens)."""
    return [
        row(model, [(1, 4, 6), (1, 6, 4)], seed=0, frames_apart=frames_apart),
        row(model, [(1, 4, 4)], videos=[(3, 4, 6)], pre=2, seed=1, frames_apart=frames_apart),
        row(model, [], seed=text_seed, frames_apart=frames_apart),
    ]
