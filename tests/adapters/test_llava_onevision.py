"""LLaVA-OneVision: anyres-max grids, multi-image prompts, pooled video frames, refusals.

The oracles are the model's own tensors (the embeddings its decoder receives, where every
newline token is a copy of ``image_newline``) and the project's measured token counts."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS
from lightkv_lab.tiny import llava_onevision as ov

from lightkv import Pipeline
from lightkv.adapters import apply
from lightkv.adapters.llava_onevision import LlavaOnevisionAdapter
from lightkv.graph import TokenKind
from lightkv.policies import ExplicitSchedule
from lightkv.testing import IMAGE, VIDEO

from .conftest import get_model, tiny_lightkv

NOTHING = Pipeline(scheduler=ExplicitSchedule(layers=(), windows_per_side=()), name="nothing")


def _layout_and_embeds(model, batch, generate=False):
    seen = {}
    hook = model.model.language_model.layers[0].register_forward_pre_hook(
        lambda m, a: seen.setdefault("x", a[0])
    )
    try:
        with apply(NOTHING, model) as session:
            model.generate(**batch, max_new_tokens=1) if generate else model(**batch)
    finally:
        hook.remove()
    return session.last_prefill.layout, seen["x"]


# tile grid -> (image size in pixels of 16-px tiles, hi-res grid after the shrink, tokens measured)
FACTS = {
    (2, 3): ((32, 48), (8, 12), 120),
    (3, 6): ((48, 96), (8, 16), 152),
    (6, 6): ((96, 96), (12, 12), 172),
}


@pytest.mark.parametrize("tiles", list(FACTS))
def test_anyres_max_grids_match_the_measured_token_counts(tiles):
    model = get_model("llava_onevision")
    size, grid, count = FACTS[tiles]
    assert ov.tokens(model, size) == count
    batch = ov.collate([ov.row(model, [size])])
    layout, x = _layout_and_embeds(model, batch)
    assert layout.image_grid.tolist() == [
        [4, 4],
        list(grid),
    ]  # base tile first, then the stitched map
    assert int(layout.vision_mask.sum()) == 16 + grid[0] * grid[1]
    structural = layout.kind == TokenKind.STRUCTURAL
    assert torch.equal(structural, (x == model.model.image_newline).all(-1))  # one newline per row
    assert int(structural.sum()) == grid[0]
    base = layout.image[0] == 0
    assert not (structural & base).any()  # no newline after the base tile


def test_every_placeholder_is_a_vision_token_or_a_model_newline():
    model = get_model("llava_onevision")
    batch = ov.collate(ov.examples(model))
    for generate in (False, True):
        layout, x = _layout_and_embeds(model, batch, generate)
        placeholders = (batch["input_ids"] == IMAGE) | (batch["input_ids"] == VIDEO)
        at_newline = (x == model.model.image_newline).all(-1)
        assert torch.equal(layout.vision_mask, placeholders & ~at_newline)
        assert torch.equal(layout.kind == TokenKind.STRUCTURAL, placeholders & at_newline)


def test_several_images_in_a_prompt_are_base_tiles_with_one_newline():
    model = get_model("llava_onevision")
    batch = ov.collate([ov.row(model, [(30, 18), (16, 16), (96, 96)])])
    assert batch["batch_num_images"].tolist() == [3]
    layout, x = _layout_and_embeds(model, batch)
    assert layout.image_grid.tolist() == [[4, 4]] * 3
    structural = (layout.kind == TokenKind.STRUCTURAL)[0].nonzero().squeeze(1)
    starts = (batch["input_ids"][0] == IMAGE).nonzero().squeeze(1)[0]
    assert (structural - starts).tolist() == [
        16,
        16 + 18,
        16 + 36,
    ]  # after each base tile (+ a text token)
    assert (x[0, structural] == model.model.image_newline).all()
    assert layout.image[0, structural].tolist() == [0, 1, 2]


def test_video_frames_are_pooled_segments_of_one_video_with_a_trailing_newline():
    model = get_model("llava_onevision")
    frames = 4
    row = ov.row(model, [], videos=[frames, frames], pre=2)
    batch = ov.collate([row, ov.row(model, [(20, 30)], seed=1)])
    with torch.no_grad():
        pooled = model.model.get_video_features(batch["pixel_values_videos"]).pooler_output
    assert pooled.shape[1] == frames * 2 * 2 + 1 == ov.video_tokens(model, frames)
    layout, x = _layout_and_embeds(model, batch)
    video = layout.image_video >= 0
    assert layout.image_grid[video].tolist() == [[2, 2]] * (2 * frames)  # ceil(4 / 2) per side
    assert layout.image_frame[video].tolist() == list(range(frames)) * 2
    assert layout.image_video[video].tolist() == [0] * frames + [1] * frames
    assert (layout.image_row[video] == 0).all()
    # the single newline of each video follows its last frame and is the model's newline
    in_videos = (layout.video[0] >= 0) & (layout.kind[0] == TokenKind.STRUCTURAL)
    assert int(in_videos.sum()) == 2
    assert (x[0, in_videos] == model.model.image_newline).all()
    assert layout.frame[0, in_videos].tolist() == [frames - 1] * 2


def test_mixed_images_and_videos_generate_with_compression_and_keep_structural_tokens():
    model = get_model("llava_onevision")
    batch = ov.collate(ov.examples(model))
    with apply(tiny_lightkv(), model) as session:
        out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 2
    first, final = session.last_prefill.layout, session.last_prefill.final_layout
    assert int(final.vision_mask.sum()) < int(first.vision_mask.sum())
    for b in range(first.batch_size):  # every structural token survives, at its own position
        before = (first.kind[b] == TokenKind.STRUCTURAL).nonzero().squeeze(1)
        after = final.origin[b][final.kind[b] == TokenKind.STRUCTURAL]
        assert sorted(after.tolist()) == before.tolist()


def test_a_smaller_anyres_max_shrinks_more():
    model = ov.build(vision_aspect_ratio="anyres_max_4", num_layers=1)
    batch = ov.collate([ov.row(model, [(96, 96)])])
    layout, x = _layout_and_embeds(model, batch)
    assert layout.image_grid.tolist() == [[4, 4], [8, 8]]  # sqrt(576 / (4 * 16)) = 3: 24 -> 8
    assert torch.equal(
        layout.kind == TokenKind.STRUCTURAL, (x == model.model.image_newline).all(-1)
    )


def test_a_cls_token_in_the_grid_is_refused():
    from transformers import (
        CLIPVisionConfig,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
    )

    model = get_model("llava_onevision")
    with pytest.raises(
        NotImplementedError, match="keeps 15 of the SiglipVisionModel tower's 16 tokens"
    ):
        LlavaOnevisionAdapter(model).build_layout(
            {"input_ids": torch.full((1, 3), IMAGE), "vision_feature_select_strategy": "default"},
            None,
        )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    )
    cfg = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=model.config.text_config,
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        image_grid_pinpoints=model.config.image_grid_pinpoints,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    )
    clip = LlavaOnevisionForConditionalGeneration(cfg)
    with pytest.raises(NotImplementedError, match="use 'default' for towers with a CLS token"):
        apply(tiny_lightkv(), clip)
    clip.config.vision_feature_select_strategy = "default"
    assert (
        LlavaOnevisionAdapter(clip).family == "llava_onevision"
    )  # CLIP with CLS dropped is a grid


def test_an_unknown_aspect_ratio_mode_is_refused():
    model = ov.build(num_layers=1)
    model.config.vision_aspect_ratio = "pad"
    with pytest.raises(NotImplementedError, match="vision_aspect_ratio 'anyres_max_<N>'"):
        LlavaOnevisionAdapter(model)


def test_the_family_is_detected_and_listed():
    from lightkv.adapters import SUPPORTED_FAMILIES, get_adapter

    assert "llava_onevision" in SUPPORTED_FAMILIES and "llava_onevision" in TINY_MODELS
    assert isinstance(get_adapter(get_model("llava_onevision")), LlavaOnevisionAdapter)


@pytest.mark.parametrize("size", [(8, 120), (120, 8), (4, 64)])
def test_extreme_aspect_ratios_keep_their_newlines_structural(size):
    model = get_model("llava_onevision")
    batch = ov.collate([ov.row(model, [size]), ov.row(model, [], videos=[3], seed=1)])
    layout, x = _layout_and_embeds(model, batch)
    placeholders = (batch["input_ids"] == IMAGE) | (batch["input_ids"] == VIDEO)
    at_newline = (x == model.model.image_newline).all(-1)
    assert torch.equal(layout.kind == TokenKind.STRUCTURAL, placeholders & at_newline)
    with apply(tiny_lightkv(), model):
        model.generate(**batch, max_new_tokens=1, do_sample=False)
