"""Tiny random LLaVA-1.5 models (CLIP tower, LLaMA decoder) and prompts for them: `TINY_LLAVA`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .common import (
    IMAGE,
    Row,
    TinyModel,
    _batch_ids,
    _clip_llama_configs,
    _finish,
    _seq,
    text_ids,
)


def build_llava(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    image_size=32,
    patch_size=4,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
):
    """LLaVA-1.5-shaped: CLIP tower (1 layer) + LLaMA decoder; ``(image_size/patch_size)^2`` tokens
    per image."""
    from transformers import (
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(seed)
    vision, text = _clip_llama_configs(
        image_size, patch_size, num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        attn_implementation=attn_implementation,
    )
    return _finish(LlavaForConditionalGeneration(cfg), dtype)


def row_llava(model, images: int = 1, pre: int = 4, post: int = 5, seed: int = 0) -> Row:
    """``pre`` text tokens, ``images`` images (one text token after each), ``post`` text tokens."""
    g = torch.Generator().manual_seed(seed)
    vc = model.config.vision_config
    n = (vc.image_size // vc.patch_size) ** 2
    parts = [text_ids(pre, g)]
    for _ in range(images):
        parts += [torch.full((n,), IMAGE), text_ids(1, g)]
    parts.append(text_ids(post, g))
    pixels = torch.randn(images, 3, vc.image_size, vc.image_size, generator=g)
    return Row(_seq(*parts), {"pixel_values": pixels} if images else {})


def collate_llava(rows: Sequence[Row]) -> dict:
    out = _batch_ids(rows)
    pix = [r.images["pixel_values"] for r in rows if r.images]
    if pix:
        out["pixel_values"] = torch.cat(pix)
    return out


def examples_llava(model) -> list[Row]:
    return [
        row_llava(model, 1, seed=0),
        row_llava(model, 2, pre=2, seed=1),
        row_llava(model, 0, seed=2),
    ]


TINY_LLAVA = TinyModel("llava", build_llava, row_llava, collate_llava, examples_llava)
"""The tiny random LLaVA-1.5 the docs and a package's own tests run sessions on:
``TINY_LLAVA.build()``, ``.row(model, images=1, seed=0)``, ``.collate(rows)``. Every other
family's tiny model is in the laboratory (``lightkv_lab.tiny.TINY_MODELS``)."""
