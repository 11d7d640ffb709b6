"""Each adapter reads the layout the model really builds, checked against the model's own
tensors (not against the adapter's arithmetic)."""

from __future__ import annotations

import torch
from lightkv_lab.tiny import TINY_MODELS

from lightkv import Pipeline
from lightkv.adapters import apply, get_adapter
from lightkv.graph.layout import TokenKind
from lightkv.policies import ExplicitSchedule
from lightkv.testing import IMAGE, NEWLINE, VIDEO

from .conftest import decoder_layers, get_model, tiny_lightkv

NOTHING = Pipeline(scheduler=ExplicitSchedule(layers=(), windows_per_side=()), name="nothing")


def _layout(model, family, batch, generate=False):
    fam = TINY_MODELS[family]
    with apply(NOTHING, model, **fam.adapter_options) as session:
        if generate:
            model.generate(**batch, max_new_tokens=1)
        else:
            model(**batch)
    return session.last_prefill.layout


def test_layout_is_the_same_for_forward_and_generate(family):
    """generate() pre-encodes images and drops image_sizes / grids from the forward; the
    layout read from what it passes instead must be the same."""
    model = get_model(family)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    assert _layout(model, family, batch) == _layout(model, family, batch, generate=True)


def test_vision_tokens_are_the_placeholders(family):
    model = get_model(family)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    layout = _layout(model, family, batch)
    image_like = (batch["input_ids"] == IMAGE) | (batch["input_ids"] == VIDEO)
    structural = layout.kind == TokenKind.STRUCTURAL
    assert not (layout.vision_mask & ~image_like).any()
    # placeholders that are not mergeable are structural (LLaVA-NeXT's newline placeholders)
    assert torch.equal(image_like & ~layout.vision_mask, image_like & structural)
    assert torch.equal(layout.kind == TokenKind.PAD, batch["attention_mask"] == 0)


def test_llava_next_newlines_are_the_models_newline_embedding():
    model = get_model("llava_next")
    fam = TINY_MODELS["llava_next"]
    batch = fam.collate(fam.examples(model))
    seen = {}
    hook = model.model.language_model.layers[0].register_forward_pre_hook(
        lambda m, a: seen.__setitem__("x", a[0])
    )
    try:
        layout = _layout(model, "llava_next", batch)
    finally:
        hook.remove()
    structural = layout.kind == TokenKind.STRUCTURAL
    newline = model.model.image_newline
    at_newline = (seen["x"] == newline).all(-1)
    assert structural.any() and torch.equal(structural, at_newline)
    # base grid then high-resolution grid per image
    grids = layout.image_grid.tolist()
    assert grids[0] == [4, 4] and grids[2] == [4, 4] and grids[4] == [4, 4]


def test_qwen_grids_follow_mrope_positions():
    """Every vision token's (row, col) is its M-RoPE (h, w) minus the image's origin;
    video frames are separate grids with increasing temporal positions."""
    model = get_model("qwen2_5_vl")
    fam = TINY_MODELS["qwen2_5_vl"]
    batch = fam.collate(fam.examples(model))
    layout = _layout(model, "qwen2_5_vl", batch)
    pos, _ = model.model.get_rope_index(
        batch["input_ids"],
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        batch["video_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    for s in range(layout.num_images):
        b = int(layout.image_row[s])
        mine = layout.image[b] == s
        t, h, w = (pos[k, b][mine] for k in range(3))
        assert (t == t[0]).all()
        assert torch.equal(layout.coords[b][mine][:, 0], h - h.min())
        assert torch.equal(layout.coords[b][mine][:, 1], w - w.min())
    assert layout.image_grid.tolist() == [[4, 6], [6, 4], [4, 4], [4, 4]]


def test_internvl_one_grid_per_tile():
    model = get_model("internvl")
    fam = TINY_MODELS["internvl"]
    batch = fam.collate(fam.examples(model))
    layout = _layout(model, "internvl", batch)
    assert layout.num_images == batch["pixel_values"].shape[0]  # 1 + (3 + 1) tiles
    assert layout.image_grid.tolist() == [[6, 6]] * 5
    assert layout.image_row.tolist() == [0, 1, 1, 1, 1]


def test_fuyu_rows_end_with_structural_newlines():
    model = get_model("fuyu")
    fam = TINY_MODELS["fuyu"]
    batch = fam.collate(fam.examples(model))
    layout = _layout(model, "fuyu", batch)
    assert torch.equal(layout.kind == TokenKind.STRUCTURAL, batch["input_ids"] == NEWLINE)
    assert layout.image_grid.tolist() == [[5, 6], [6, 4], [3, 5]]
    # without the option the newline id is detected from the prompt
    detected = get_adapter(model).build_layout(batch, batch["attention_mask"] == 0)
    assert detected == layout


def test_surviving_tokens_keep_their_positions(family):
    """After compression every layer receives, for each surviving token, exactly the
    rotary embedding of its original position (3-D M-RoPE for Qwen2.5-VL)."""
    model = get_model(family)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    layers = decoder_layers(model)
    seen = {}
    hooks = [
        layers[i].self_attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen.__setitem__(i, kw["position_embeddings"]), with_kwargs=True
        )
        for i in (0, 3)
    ]
    try:
        with apply(tiny_lightkv(), model, **fam.adapter_options) as session:
            model.generate(**batch, max_new_tokens=1)
    finally:
        for h in hooks:
            h.remove()
    origin = session.last_prefill.final_layout.origin
    full_cos, full_sin = seen[0]
    cos, sin = seen[3]
    assert cos.shape[1] == origin.shape[1] < full_cos.shape[1]
    for b in range(origin.shape[0]):
        keep = origin[b] >= 0
        fb = min(b, full_cos.shape[0] - 1)
        assert torch.equal(cos[b][keep], full_cos[fb][origin[b][keep]])
        assert torch.equal(sin[b][keep], full_sin[fb][origin[b][keep]])
