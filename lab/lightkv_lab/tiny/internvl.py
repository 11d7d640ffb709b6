"""Tiny random InternVL models (InternViT, pixel shuffle, Qwen2 decoder) and prompts for
them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightkv.testing.common import (
    IMAGE,
    IMG_END,
    IMG_START,
    Row,
    _finish,
    _seq,
    _text_config,
    text_ids,
)


def build_internvl(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    image_size=48,
    patch_size=4,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
):
    """InternVL-shaped: 1-layer InternViT, pixel shuffle 0.5, Qwen2 decoder;
    ``(image_size / patch_size / 2)^2`` tokens per tile."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=[image_size, image_size],
        patch_size=[patch_size, patch_size],
    )
    text = _text_config(
        model_type="qwen2",
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
    )
    cfg = InternVLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE,
        downsample_ratio=0.5,
        image_seq_length=(image_size // patch_size // 2) ** 2,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
    return _finish(InternVLForConditionalGeneration(cfg), dtype)


def row_internvl(
    model, images: Sequence[int] | int = (1,), pre: int = 4, post: int = 5, seed: int = 0
) -> Row:
    """One image per entry of ``images`` (its number of tiles), each wrapped in
    ``<img>`` / ``</img>`` marker tokens."""
    if isinstance(images, int):
        images = [1] * images
    g = torch.Generator().manual_seed(seed)
    vc = model.config.vision_config
    size = vc.image_size[0]
    per_tile = model.config.image_seq_length
    parts = [text_ids(pre, g)]
    pix = []
    for tiles in images:
        parts += [
            torch.tensor([IMG_START]),
            torch.full((tiles * per_tile,), IMAGE),
            torch.tensor([IMG_END]),
            text_ids(1, g),
        ]
        pix.append(torch.randn(tiles, 3, size, size, generator=g))
    parts.append(text_ids(post, g))
    return Row(_seq(*parts), {"pixel_values": torch.cat(pix)} if pix else {})


def examples_internvl(model) -> list[Row]:
    return [
        row_internvl(model, [1], seed=0),
        row_internvl(model, [3, 1], pre=2, seed=1),
        row_internvl(model, [], seed=2),
    ]
