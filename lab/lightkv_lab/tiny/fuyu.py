"""Tiny random Fuyu models (patches straight into a Persimmon decoder) and prompts for
them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightkv.testing.common import (
    IMAGE,
    NEWLINE,
    PAD,
    VOCAB,
    Row,
    _batch_ids,
    _finish,
    _seq,
    text_ids,
)


def build_fuyu(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    patch_size=4,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
):
    """Fuyu-shaped: patches projected straight into a Persimmon decoder (qk layer norm,
    partial rotary embedding)."""
    from transformers import FuyuConfig, FuyuForCausalLM

    torch.manual_seed(seed)
    text = dict(
        model_type="persimmon",
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        max_position_embeddings=4096,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        qk_layernorm=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 25000.0,
            "partial_rotary_factor": 0.5,
        },
    )
    cfg = FuyuConfig(
        text_config=text,
        patch_size=patch_size,
        num_channels=3,
        image_token_id=IMAGE,
        attn_implementation=attn_implementation,
    )
    return _finish(FuyuForCausalLM(cfg), dtype)


def row_fuyu(
    model,
    images: Sequence[tuple[int, int]] | int = ((5, 6),),
    pre: int = 4,
    post: int = 5,
    seed: int = 0,
) -> Row:
    """One image per ``(rows, cols)`` patch grid: ``cols`` placeholders and a newline per row."""
    if isinstance(images, int):
        images = [(5, 6)] * images
    g = torch.Generator().manual_seed(seed)
    dim = model.config.patch_size**2 * model.config.num_channels
    parts = [text_ids(pre, g)]
    pix = []
    for rows, cols in images:
        for _ in range(rows):
            parts += [torch.full((cols,), IMAGE), torch.tensor([NEWLINE])]
        parts.append(text_ids(1, g))
        pix.append(torch.randn(rows * cols, dim, generator=g))
    parts.append(text_ids(post, g))
    return Row(_seq(*parts), {"pixel_values": torch.cat(pix)} if pix else {})


def collate_fuyu(rows: Sequence[Row]) -> dict:
    out = _batch_ids(rows)
    pix = [r.images["pixel_values"] for r in rows if r.images]
    if pix:  # the model fills placeholders in flattened order: one sequence of patches
        out["pixel_values"] = torch.cat(pix).unsqueeze(0)
    return out


def examples_fuyu(model) -> list[Row]:
    return [
        row_fuyu(model, [(5, 6)], seed=0),
        row_fuyu(model, [(6, 4), (3, 5)], pre=2, seed=1),
        row_fuyu(model, [], seed=2),
    ]
