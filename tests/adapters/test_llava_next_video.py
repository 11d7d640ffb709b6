"""LLaVA-NeXT-Video: LLaVA-NeXT image grids, pooled video frames without newlines, refusals.

The oracles are the model's own tensors (the embeddings its decoder receives, the pooled
video features) and grids computed from the config, not from the adapter."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS
from lightkv_lab.tiny import llava_next_video as nv

from lightkv import Pipeline
from lightkv.adapters import apply
from lightkv.adapters.llava_next_video import LlavaNextVideoAdapter
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


def test_images_are_llava_next_grids_with_row_newlines():
    model = get_model("llava_next_video")
    batch = nv.collate([nv.row(model, [(20, 30), (30, 18)])])
    layout, x = _layout_and_embeds(model, batch)
    # (20, 30) picks 32 x 32 px (2 x 2 tiles, 8 x 8 tokens); un-padding keeps rows 1..6 of 8
    # (round(20 * 8 / 30) = 5 rows, padding (8 - 5) // 2 = 1 cut from each side): 6 x 8
    # (30, 18) picks 32 x 16 px (2 x 1 tiles, 8 x 4 tokens); round(30 * 4 / 18) = 7 rows,
    # padding (8 - 7) // 2 = 0: 8 x 4
    assert layout.image_grid.tolist() == [[4, 4], [6, 8], [4, 4], [8, 4]]
    structural = layout.kind == TokenKind.STRUCTURAL
    assert torch.equal(structural, (x == model.model.image_newline).all(-1))
    assert int(structural.sum()) == 6 + 8
    assert torch.equal(layout.vision_mask, (batch["input_ids"] == IMAGE) & ~structural)


def test_every_placeholder_is_a_vision_token_or_a_model_newline():
    model = get_model("llava_next_video")
    batch = nv.collate(nv.examples(model))
    for generate in (False, True):
        layout, x = _layout_and_embeds(model, batch, generate)
        placeholders = (batch["input_ids"] == IMAGE) | (batch["input_ids"] == VIDEO)
        at_newline = (x == model.model.image_newline).all(-1)
        assert torch.equal(layout.vision_mask, placeholders & ~at_newline)
        assert torch.equal(layout.kind == TokenKind.STRUCTURAL, placeholders & at_newline)
        assert not (
            layout.kind[batch["input_ids"] == VIDEO] == TokenKind.STRUCTURAL
        ).any()  # no video newline


@pytest.mark.parametrize(
    "mode,stride,side", [("average", 2, 2), ("max", 3, 1), ("conv", 2, 2), ("average", 1, 4)]
)
def test_video_frames_are_pooled_segments_of_one_video(mode, stride, side):
    model = nv.build(spatial_pool_mode=mode, spatial_pool_stride=stride, num_layers=1)
    frames = 3
    batch = nv.collate(
        [nv.row(model, [], videos=[frames, frames], pre=2), nv.row(model, [(20, 30)], seed=1)]
    )
    with torch.no_grad():
        pooled = model.model.get_video_features(batch["pixel_values_videos"]).pooler_output
    assert tuple(pooled.shape[:2]) == (
        2,
        frames * side * side,
    )  # frames concatenated, nothing after them
    layout, _ = _layout_and_embeds(model, batch)
    video = layout.image_video >= 0
    assert layout.image_grid[video].tolist() == [[side, side]] * (2 * frames)
    assert layout.image_frame[video].tolist() == list(range(frames)) * 2
    assert layout.image_video[video].tolist() == [0] * frames + [1] * frames
    assert torch.equal(layout.video[0] >= 0, batch["input_ids"][0] == VIDEO)
    assert layout.kind[0][batch["input_ids"][0] == VIDEO].eq(TokenKind.VISION).all()


def test_extreme_aspect_ratio_newlines_without_columns_are_structural():
    model = get_model("llava_next_video")
    for size in [(8, 120), (120, 8), (4, 64)]:
        batch = nv.collate([nv.row(model, [size]), nv.row(model, [(20, 30)], videos=[2], seed=1)])
        layout, x = _layout_and_embeds(model, batch)
        placeholders = batch["input_ids"] == IMAGE
        at_newline = (x == model.model.image_newline).all(-1)
        assert torch.equal(layout.kind == TokenKind.STRUCTURAL, placeholders & at_newline)
        with apply(tiny_lightkv(), model):
            model.generate(**batch, max_new_tokens=1, do_sample=False)


def test_mixed_images_and_videos_compress_and_keep_structural_tokens():
    model = get_model("llava_next_video")
    batch = nv.collate(nv.examples(model))
    with apply(tiny_lightkv(), model) as session:
        out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 2
    first, final = session.last_prefill.layout, session.last_prefill.final_layout
    assert int(final.vision_mask.sum()) < int(first.vision_mask.sum())
    for b in range(first.batch_size):
        before = (first.kind[b] == TokenKind.STRUCTURAL).nonzero().squeeze(1)
        after = final.origin[b][final.kind[b] == TokenKind.STRUCTURAL]
        assert sorted(after.tolist()) == before.tolist()


def test_a_cls_token_in_the_grid_is_refused():
    model = get_model("llava_next_video")
    with pytest.raises(
        NotImplementedError, match="keeps 17 of the CLIPVisionModel tower's 17 tokens"
    ):
        LlavaNextVideoAdapter(model).build_layout(
            {"input_ids": torch.full((1, 3), VIDEO), "vision_feature_select_strategy": "full"}, None
        )
    full = nv.build(num_layers=1)
    full.config.vision_feature_select_strategy = "full"
    with pytest.raises(NotImplementedError, match="use 'default' for towers with a CLS token"):
        apply(tiny_lightkv(), full)


def test_the_family_is_detected_and_listed():
    from lightkv.adapters import SUPPORTED_FAMILIES, get_adapter

    assert "llava_next_video" in SUPPORTED_FAMILIES and "llava_next_video" in TINY_MODELS
    assert isinstance(get_adapter(get_model("llava_next_video")), LlavaNextVideoAdapter)
