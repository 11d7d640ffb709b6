"""Tiny random LLaVA-NeXT models (CLIP tower, LLaMA decoder, any-resolution tiles) and
prompts for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightkv.testing.common import (
    IMAGE,
    Row,
    _batch_ids,
    _clip_llama_configs,
    _finish,
    _seq,
    stack_tiles,
    text_ids,
)


def build_llava_next(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    image_size=16,
    patch_size=4,
    pinpoints=((16, 32), (32, 16), (32, 32)),
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
):
    """LLaVA-NeXT-shaped: ``(image_size/patch_size)^2`` base tokens per image plus an
    un-padded high-resolution grid (tiles chosen from ``pinpoints``) with row newlines."""
    from transformers import (
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
    )

    torch.manual_seed(seed)
    vision, text = _clip_llama_configs(
        image_size, patch_size, num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads
    )
    cfg = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE,
        image_grid_pinpoints=[list(p) for p in pinpoints],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        attn_implementation=attn_implementation,
    )
    model = LlavaNextForConditionalGeneration(cfg)
    with torch.no_grad():  # the newline embedding is created empty; give it values
        model.model.image_newline.normal_(generator=torch.Generator().manual_seed(seed))
    return _finish(model, dtype)


def llava_next_tokens(model, image_size: tuple[int, int]) -> int:
    """Placeholder tokens of one image, as the model itself packs it."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    cfg = model.config
    tiles = image_size_to_num_patches(
        list(image_size), cfg.image_grid_pinpoints, cfg.vision_config.image_size
    )
    side = cfg.vision_config.image_size
    pixels = torch.zeros(1, tiles, 3, side, side, dtype=model.dtype, device=model.device)
    with torch.no_grad():
        feats = model.model.get_image_features(
            pixels, torch.tensor([list(image_size)], device=model.device)
        ).pooler_output
    return int(feats[0].shape[0])


def row_llava_next(
    model,
    images: Sequence[tuple[int, int]] | int = ((20, 30),),
    pre: int = 4,
    post: int = 5,
    seed: int = 0,
) -> Row:
    """One image per ``(height, width)`` in ``images`` (any sizes), text around them."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    if isinstance(images, int):
        images = [(20, 30)] * images
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    side = cfg.vision_config.image_size
    parts = [text_ids(pre, g)]
    pixels = []
    for size in images:
        parts += [torch.full((llava_next_tokens(model, size),), IMAGE), text_ids(1, g)]
        tiles = image_size_to_num_patches(list(size), cfg.image_grid_pinpoints, side)
        pixels.append(torch.randn(tiles, 3, side, side, generator=g))
    parts.append(text_ids(post, g))
    if not images:
        return Row(_seq(*parts))
    return Row(
        _seq(*parts),
        {"pixel_values": pixels, "image_sizes": torch.tensor([list(s) for s in images])},
    )


def collate_llava_next(rows: Sequence[Row]) -> dict:
    out = _batch_ids(rows)
    pix = [p for r in rows if r.images for p in r.images["pixel_values"]]
    if pix:
        out["pixel_values"] = stack_tiles(pix)
        out["image_sizes"] = torch.cat([r.images["image_sizes"] for r in rows if r.images])
    return out


def examples_llava_next(model) -> list[Row]:
    return [
        row_llava_next(model, [(20, 30)], seed=0),
        row_llava_next(model, [(30, 18), (16, 16)], pre=2, seed=1),
        row_llava_next(model, [], seed=2),
    ]
