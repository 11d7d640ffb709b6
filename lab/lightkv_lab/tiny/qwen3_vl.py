"""Tiny random Qwen3-VL, and prompts with images and per-frame videos for it.

The vision tower has one DeepStack block (``deepstack_visual_indexes=[0]``): the decoder
adds its features after decoder layer 0, so schedules from layer 1 on are exact.
"""

from __future__ import annotations

import torch

from lightkv.testing.common import (
    IMAGE,
    VIDEO,
    VISION_END,
    VISION_START,
    Row,
    _finish,
    _text_config,
)

from . import qwen2_vl

__all__ = ["build", "collate", "examples", "row"]

collate = qwen2_vl.collate


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
    deepstack=(0,),
    vision_depth=1,
):
    """Qwen3-VL-shaped: ``vision_depth``-block vision tower with DeepStack features from the
    blocks in ``deepstack``, interleaved 3-D M-RoPE, Qwen3 decoder (q/k norms)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    head_dim = hidden_size // num_heads
    hw = head_dim // 8  # Qwen3-VL's 24/20/20 of the rotary half, scaled
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [head_dim // 2 - 2 * hw, hw, hw],
        "mrope_interleaved": True,
    }
    text = _text_config(
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rope_parameters=rope,
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=hidden_size,
        num_position_embeddings=16,
        deepstack_visual_indexes=list(deepstack),
    )
    cfg = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        attn_implementation=attn_implementation,
    )
    return _finish(Qwen3VLForConditionalGeneration(cfg), dtype)


def row(
    model,
    images=((1, 4, 6),),
    videos=(),
    pre: int = 4,
    post: int = 5,
    seed: int = 0,
    videos_first: bool = False,
) -> Row:
    """Like `lightkv_lab.tiny.qwen2_vl.row`, each video frame after its own timestamp."""
    return qwen2_vl.row(model, images, videos, pre, post, seed, videos_first, frames_apart=True)


def examples(model) -> list[Row]:
    """Two images; an image and a 3-frame video; text only."""
    return qwen2_vl.examples(model, frames_apart=True, text_seed=4)
