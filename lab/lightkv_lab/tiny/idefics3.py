"""Tiny Idefics3 and SmolVLM models, and prompts laid out as their processors lay them out.

An image split into ``rows x cols`` tiles is, in the prompt (``Idefics3Processor``):
for every tile row ``i`` and column ``j``, ``<fake_token_around_image> <row_i_col_j>`` and the
tile's ``L`` ``<image>`` placeholders, a ``\\n`` after each tile row, then
``\\n <fake_token_around_image> <global-img>``, the global view's ``L`` placeholders and
``<fake_token_around_image>``. An image that is not split (``(0, 0)``) is the global part
alone. ``pixel_values`` hold the tiles in that order (the global view last), batched as
``[B, max_tiles, 3, S, S]`` with all-zero padding tiles, which the model drops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightkv.testing.common import (
    IMAGE,
    PAD,
    Row,
    _batch_ids,
    _finish,
    _seq,
    _text_config,
    text_ids,
)

__all__ = [
    "FAKE",
    "GLOBAL_IMG",
    "LINE",
    "build_idefics3",
    "build_smolvlm",
    "collate",
    "examples",
    "row",
    "row_col",
]

LINE = 91  # "\n"
FAKE = 114  # "<fake_token_around_image>"
GLOBAL_IMG = 115  # "<global-img>"
_ROW_COL = 116  # "<row_1_col_1>" .. "<row_3_col_4>": 116 .. 127


def row_col(i: int, j: int) -> int:
    """The id of the ``<row_{i+1}_col_{j+1}>`` marker (tiles up to 3 x 4)."""
    if not (0 <= i < 3 and 0 <= j < 4):
        raise ValueError(
            f"the tiny models have row/column markers for 3 x 4 tiles, not tile ({i}, {j})"
        )
    return _ROW_COL + 4 * i + j


def _build(
    cls_config,
    cls_model,
    vision_cls,
    attn_implementation,
    dtype,
    seed,
    num_layers,
    image_size,
    patch_size,
    scale_factor,
    hidden_size,
    intermediate_size,
    num_heads,
    num_kv_heads,
):
    from transformers import LlamaConfig

    torch.manual_seed(seed)
    vision = vision_cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )
    text = LlamaConfig(
        **_text_config(
            num_hidden_layers=num_layers,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
        )
    )
    cfg = cls_config(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE,
        scale_factor=scale_factor,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
    return _finish(cls_model(cfg), dtype)


def build_idefics3(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    image_size=32,
    patch_size=4,
    scale_factor=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
):
    """Idefics3-shaped: 1-layer SigLIP tower, pixel shuffle 2, LLaMA decoder; 4 x 4 tokens per
    tile."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3VisionConfig

    return _build(
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3VisionConfig,
        attn_implementation,
        dtype,
        seed,
        num_layers,
        image_size,
        patch_size,
        scale_factor,
        hidden_size,
        intermediate_size,
        num_heads,
        num_kv_heads,
    )


def build_smolvlm(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    image_size=32,
    patch_size=2,
    scale_factor=4,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
):
    """SmolVLM-shaped: 1-layer SigLIP tower, pixel shuffle 4, LLaMA decoder; 4 x 4 tokens per
    tile."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMVisionConfig

    return _build(
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMVisionConfig,
        attn_implementation,
        dtype,
        seed,
        num_layers,
        image_size,
        patch_size,
        scale_factor,
        hidden_size,
        intermediate_size,
        num_heads,
        num_kv_heads,
    )


def tile_tokens(model) -> int:
    """Placeholders per tile: ``(image_size / patch_size / scale_factor)^2``, as the model computes
    it."""
    return int(model.model.image_seq_len)


def image_tokens(model, tiles: tuple[int, int]) -> torch.Tensor:
    """The prompt tokens of one image split into ``tiles = (rows, cols)`` (``(0, 0)``: not
    split)."""
    n = tile_tokens(model)
    rows, cols = tiles
    parts: list = []
    for i in range(rows):
        for j in range(cols):
            parts += [[FAKE, row_col(i, j)], torch.full((n,), IMAGE)]
        parts.append([LINE])
    if rows:
        parts.append([LINE])
    parts += [[FAKE, GLOBAL_IMG], torch.full((n,), IMAGE), [FAKE]]
    return _seq(*parts)


def row(
    model,
    images: Sequence[tuple[int, int]] | int = ((2, 2),),
    pre: int = 4,
    post: int = 5,
    seed: int = 0,
) -> Row:
    """One image per ``(rows, cols)`` tile grid (``(0, 0)``: a single global view)."""
    if isinstance(images, int):
        images = [(2, 2)] * images
    g = torch.Generator().manual_seed(seed)
    size = int(model.config.vision_config.image_size)
    parts = [text_ids(pre, g)]
    tiles = 0
    for grid in images:
        parts += [image_tokens(model, grid), text_ids(1, g)]
        tiles += grid[0] * grid[1] + 1
    parts.append(text_ids(post, g))
    if not images:
        return Row(_seq(*parts))
    return Row(_seq(*parts), {"pixel_values": torch.randn(tiles, 3, size, size, generator=g)})


def collate(rows: Sequence[Row]) -> dict:
    """Left-padded ids; ``pixel_values`` ``[B, max_tiles, 3, S, S]`` with all-zero padding tiles."""
    out = _batch_ids(rows)
    pix = [r.images.get("pixel_values") for r in rows]
    if any(p is not None for p in pix):
        shape = next(p for p in pix if p is not None).shape[1:]
        most = max(p.shape[0] for p in pix if p is not None)
        stacked = torch.zeros(len(rows), most, *shape)
        for i, p in enumerate(pix):
            if p is not None:
                stacked[i, : p.shape[0]] = p
        out["pixel_values"] = stacked
    return out


def examples(model) -> list[Row]:
    """A 2 x 2-tile image; a 1 x 3-tile image and an unsplit one; a text-only row."""
    return [
        row(model, [(2, 2)], seed=0),
        row(model, [(1, 3), (0, 0)], pre=2, seed=1),
        row(model, [], seed=2),
    ]
