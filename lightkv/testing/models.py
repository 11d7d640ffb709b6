"""Tiny random models of every supported family, and prompt batches for them.

Built from config objects (no download), in well under a second each; used by the test
suite, the benchmarks and the CLI demo. Every family has:

* ``build(attn_implementation="sdpa", dtype=torch.float32, seed=0, **sizes)`` -> model,
* ``row(model, ..., seed=0)`` -> one prompt (`Row`: 1-D ``input_ids`` + the row's image inputs),
* ``collate(rows)`` -> the keyword arguments of a left-padded batch.

```python
from lightkv.testing import TINY_MODELS
fam = TINY_MODELS["llava"]
model = fam.build()
batch = fam.collate([fam.row(model, images=1, seed=0), fam.row(model, images=2, seed=1)])
model.generate(**batch, max_new_tokens=5)
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["TINY_MODELS", "TinyModel", "Row", "left_pad", "text_ids"]

from . import (  # newer families: one module each  # families with a module each
    gemma3,
    idefics3,
    llava_next_video,
    llava_onevision,
    pixtral,
    qwen2_vl,
    qwen3_vl,
)
from .common import (  # noqa: F401  (re-exported: tests and docs import them from here)
    IMAGE,
    IMG_END,
    IMG_START,
    NEWLINE,
    PAD,
    TEXT_HIGH,
    TEXT_LOW,
    VIDEO,
    VISION_END,
    VISION_START,
    VOCAB,
    Row,
    TinyModel,
    _batch_ids,
    _finish,
    _seq,
    _text_config,
    left_pad,
    stack_tiles,
    text_ids,
)


# ----------------------------------------------------------------------------- LLaVA-1.5
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
    """LLaVA-1.5-shaped: CLIP tower (1 layer) + LLaMA decoder; ``(image_size/patch_size)^2`` tokens per image."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=32,
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


# ----------------------------------------------------------------------------- LLaVA-NeXT
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
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
    )

    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=32,
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


# ----------------------------------------------------------------------------- Qwen2.5-VL
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
    """Qwen2.5-VL-shaped: 1-block vision tower (``patch_size`` px patches, 2x2 merge), 3-D M-RoPE decoder."""
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
    types, _ = left_pad([r.mm_token_type_ids for r in rows])
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


# ----------------------------------------------------------------------------- InternVL
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


# ----------------------------------------------------------------------------- Fuyu
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


# ----------------------------------------------------------------------------- registry
def examples_llava(model) -> list[Row]:
    return [
        row_llava(model, 1, seed=0),
        row_llava(model, 2, pre=2, seed=1),
        row_llava(model, 0, seed=2),
    ]


TINY_MODELS: dict[str, TinyModel] = {
    "llava": TinyModel("llava", build_llava, row_llava, collate_llava, examples_llava),
    "llava_next": TinyModel(
        "llava_next", build_llava_next, row_llava_next, collate_llava_next, examples_llava_next
    ),
    "qwen2_5_vl": TinyModel(
        "qwen2_5_vl", build_qwen2_5_vl, row_qwen2_5_vl, collate_qwen2_5_vl, examples_qwen2_5_vl
    ),
    "internvl": TinyModel(
        "internvl", build_internvl, row_internvl, collate_llava, examples_internvl
    ),
    "fuyu": TinyModel(
        "fuyu",
        build_fuyu,
        row_fuyu,
        collate_fuyu,
        examples_fuyu,
        adapter_options={"newline_token_id": NEWLINE},
        beam_search="transformers does not expand Fuyu's pre-encoded patches for beams "
        "(the unhooked model fails with 'Image features and image tokens do not match')",
    ),
    "gemma3": TinyModel("gemma3", gemma3.build, gemma3.row, gemma3.collate, gemma3.examples),
    "llava_onevision": TinyModel(
        "llava_onevision",
        llava_onevision.build,
        llava_onevision.row,
        llava_onevision.collate,
        llava_onevision.examples,
    ),
    "llava_next_video": TinyModel(
        "llava_next_video",
        llava_next_video.build,
        llava_next_video.row,
        llava_next_video.collate,
        llava_next_video.examples,
    ),
    "qwen2_vl": TinyModel(
        "qwen2_vl", qwen2_vl.build, qwen2_vl.row, qwen2_vl.collate, qwen2_vl.examples
    ),
    "qwen3_vl": TinyModel(
        "qwen3_vl", qwen3_vl.build, qwen3_vl.row, qwen3_vl.collate, qwen3_vl.examples
    ),
    "mistral3": TinyModel(
        "mistral3", pixtral.build_mistral3, pixtral.row, pixtral.collate, pixtral.examples
    ),
    "pixtral": TinyModel(
        "pixtral", pixtral.build_pixtral_llava, pixtral.row, pixtral.collate, pixtral.examples
    ),
    "idefics3": TinyModel(
        "idefics3", idefics3.build_idefics3, idefics3.row, idefics3.collate, idefics3.examples
    ),
    "smolvlm": TinyModel(
        "smolvlm", idefics3.build_smolvlm, idefics3.row, idefics3.collate, idefics3.examples
    ),
}
