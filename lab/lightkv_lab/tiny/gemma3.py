"""Tiny random Gemma 3 (``Gemma3ForConditionalGeneration``) for the test suite.

A 1-layer SigLIP tower, 8 x 8 patches average-pooled to ``mm_tokens_per_image`` = 16 tokens
(a 4 x 4 grid) per image, each image wrapped in begin/end-of-image tokens as the Gemma 3
processor does (``\\n\\n<start_of_image>`` + image tokens + ``<end_of_image>\\n\\n``), with
``token_type_ids`` (1 at image tokens: the model makes each image bidirectional).
Pan & scan crops are further images, each its own ``<start_of_image>...<end_of_image>`` run.

The decoder mixes layer types: ``layer_types`` defaults to full, full, sliding, full with a
sliding window of 8, smaller than every prompt, so the compressed sliding layer's window
is exercised while the uncompressed layers (0, 1) keep the whole prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from lightkv.testing.common import (
    IMAGE,
    Row,
    _batch_ids,
    _finish,
    _seq,
    _text_config,
    left_pad,
    text_ids,
)

__all__ = ["BOI", "EOI", "build", "collate", "examples", "row"]

BOI, EOI = 121, 122  # <start_of_image>, <end_of_image> (the placeholder is the shared IMAGE id)
LAYER_TYPES = ("full_attention", "full_attention", "sliding_attention", "full_attention")


def build(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    image_size=32,
    patch_size=4,
    tokens_per_image=16,
    sliding_window=8,
    layer_types: Sequence[str] | None = LAYER_TYPES,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
):
    """Gemma-3-shaped: SigLIP (1 layer) + pooled projector + Gemma 3 decoder (q/k norms,
    local and global RoPE, ``sliding_window`` on the sliding layers)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
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
    head_dim = hidden_size // num_heads
    text = Gemma3TextConfig(
        **_text_config(
            num_hidden_layers=num_layers,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            sliding_window=sliding_window,
            layer_types=list(layer_types) if layer_types is not None else None,
        )
    )
    # attn_implementation is a keyword of every config's constructor, not a declared field
    cfg = Gemma3Config(  # type: ignore[call-arg]
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=tokens_per_image,
        image_token_index=IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
    model = Gemma3ForConditionalGeneration(cfg)
    with (
        torch.no_grad()
    ):  # the projector and the RMSNorm weights are created as zeros; give them values
        g = torch.Generator().manual_seed(seed)
        proj = model.model.multi_modal_projector.mm_input_projection_weight
        proj.copy_(torch.randn(proj.shape, generator=g) * 0.2)
    return _finish(model, dtype)


def tokens_per_image(model) -> int:
    return int(model.config.mm_tokens_per_image)


def row(model, images: int = 1, pre: int = 4, post: int = 5, seed: int = 0) -> Row:
    """``pre`` text tokens, ``images`` images (begin/end-of-image tokens around each, one
    text token after each), ``post`` text tokens; ``token_type_ids`` 1 at image tokens."""
    g = torch.Generator().manual_seed(seed)
    vc = model.config.vision_config
    n = tokens_per_image(model)
    parts, types = [text_ids(pre, g)], [torch.zeros(pre, dtype=torch.long)]
    for _ in range(images):
        parts += [torch.tensor([BOI]), torch.full((n,), IMAGE), torch.tensor([EOI]), text_ids(1, g)]
        types += [
            torch.zeros(1, dtype=torch.long),
            torch.ones(n, dtype=torch.long),
            torch.zeros(2, dtype=torch.long),
        ]
    parts.append(text_ids(post, g))
    types.append(torch.zeros(post, dtype=torch.long))
    pixels = torch.randn(images, 3, vc.image_size, vc.image_size, generator=g)
    return Row(_seq(*parts), {"pixel_values": pixels} if images else {}, torch.cat(types))


def collate(rows: Sequence[Row]) -> dict:
    out = _batch_ids(rows)
    types = [cast(torch.Tensor, r.mm_token_type_ids) for r in rows]  # row() sets them
    out["token_type_ids"], _ = left_pad(types)
    pix = [r.images["pixel_values"] for r in rows if r.images]
    if pix:
        out["pixel_values"] = torch.cat(pix)
    return out


def examples(model) -> list[Row]:
    """One image; an image with two pan & scan crops (three runs); text only."""
    return [row(model, 1, seed=0), row(model, 3, pre=2, seed=1), row(model, 0, seed=2)]
