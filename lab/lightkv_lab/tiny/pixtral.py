"""Tiny Mistral3 and Pixtral-LLaVA models (Pixtral vision tower), and prompts laid out as
``PixtralProcessor`` lays them out.

An image of ``height x width`` pixels becomes ``h = height // d`` rows of ``w = width // d``
``[IMG]`` placeholders (``d = patch_size * spatial_merge_size``; Pixtral-LLaVA has no merge);
every row ends with ``[IMG_BREAK]``, the last one with ``[IMG_END]`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightkv.testing.common import IMAGE, Row, _batch_ids, _finish, _seq, _text_config, text_ids

__all__ = [
    "IMG_BREAK",
    "IMG_END",
    "build_mistral3",
    "build_pixtral_llava",
    "collate",
    "examples",
    "row",
]

IMG_BREAK = 112  # "[IMG_BREAK]": ends every row of an image but the last
IMG_END = 113  # "[IMG_END]": ends the last row


def _vision(patch_size: int, image_size: int):
    from transformers import PixtralVisionConfig

    # head_dim is a field of older transformers' config; newer ones take it as an extra key
    return PixtralVisionConfig(  # type: ignore[call-arg]
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
        patch_size=patch_size,
        image_size=image_size,
    )


def _text(num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads):
    from transformers import MistralConfig

    return MistralConfig(
        **_text_config(
            num_hidden_layers=num_layers,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=hidden_size // num_heads,
            sliding_window=None,
        )
    )


def build_mistral3(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    patch_size=4,
    spatial_merge_size=2,
    image_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
):
    """Mistral3-shaped: 1-layer Pixtral tower, 2x2 patch merger, Mistral decoder; an image of
    ``H x W`` pixels has ``(H // 8) x (W // 8)`` tokens."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Mistral3Config(
        vision_config=_vision(patch_size, image_size),
        text_config=_text(num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads),
        image_token_index=IMAGE,
        spatial_merge_size=spatial_merge_size,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
    return _finish(Mistral3ForConditionalGeneration(cfg), dtype)


def build_pixtral_llava(
    attn_implementation="sdpa",
    dtype=torch.float32,
    seed=0,
    num_layers=4,
    patch_size=8,
    image_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
):
    """Pixtral-12B-shaped: ``LlavaForConditionalGeneration`` with a Pixtral tower (no merge,
    ``vision_feature_select_strategy="full"``); an image of ``H x W`` pixels has
    ``(H // 8) x (W // 8)`` tokens."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    cfg = LlavaConfig(
        vision_config=_vision(patch_size, image_size),
        text_config=_text(num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads),
        image_token_id=IMAGE,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
    return _finish(LlavaForConditionalGeneration(cfg), dtype)


def token_grid(model, size: tuple[int, int]) -> tuple[int, int]:
    """``(rows, cols)`` of placeholders of an image of ``size = (height, width)`` pixels."""
    cfg = model.config
    merge = int(cfg.spatial_merge_size) if cfg.model_type == "mistral3" else 1
    d = int(cfg.vision_config.patch_size) * merge
    return int(size[0]) // d, int(size[1]) // d


def image_tokens(model, size: tuple[int, int]) -> torch.Tensor:
    """The prompt tokens of one image, as ``PixtralProcessor.replace_image_token`` builds them."""
    h, w = token_grid(model, size)
    rows = [torch.tensor([IMAGE] * w + [IMG_BREAK]) for _ in range(h)]
    rows[-1][-1] = IMG_END
    return torch.cat(rows)


def row(
    model,
    images: Sequence[tuple[int, int]] | int = ((24, 32),),
    pre: int = 4,
    post: int = 5,
    seed: int = 0,
) -> Row:
    """One image per ``(height, width)`` in pixels (multiples of the tower's patch times the
    merge)."""
    if isinstance(images, int):
        images = [(24, 32)] * images
    g = torch.Generator().manual_seed(seed)
    parts = [text_ids(pre, g)]
    pixels = []
    for size in images:
        parts += [image_tokens(model, size), text_ids(1, g)]
        pixels.append(torch.randn(3, int(size[0]), int(size[1]), generator=g))
    parts.append(text_ids(post, g))
    if not images:
        return Row(_seq(*parts))
    return Row(
        _seq(*parts),
        {"pixel_values": pixels, "image_sizes": torch.tensor([list(s) for s in images])},
    )


def collate(rows: Sequence[Row]) -> dict:
    """Left-padded ids; images zero-padded to the batch's largest height and width (as the
    Pixtral image processor pads them), with ``image_sizes``."""
    out = _batch_ids(rows)
    pix = [p for r in rows if r.images for p in r.images["pixel_values"]]
    if pix:
        h, w = max(p.shape[1] for p in pix), max(p.shape[2] for p in pix)
        stacked = torch.zeros(len(pix), 3, h, w)
        for i, p in enumerate(pix):
            stacked[i, :, : p.shape[1], : p.shape[2]] = p
        out["pixel_values"] = stacked
        out["image_sizes"] = torch.cat([r.images["image_sizes"] for r in rows if r.images])
    return out


def examples(model) -> list[Row]:
    """Images of different sizes (one, two and a one-row image per row) and a text-only row."""
    return [
        row(model, [(24, 32)], seed=0),
        row(model, [(32, 16), (16, 24), (8, 40)], pre=2, seed=1),
        row(model, [], seed=2),
    ]
