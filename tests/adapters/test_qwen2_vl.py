"""Qwen2-VL: images and videos on the grids the model uses (oracle: its vision tower and
rope index), frames labelled by video, mixed batches, the generate() path."""

from __future__ import annotations

import pytest
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply, get_adapter
from lightkv.adapters.qwen2_vl import label_video_frames
from lightkv.graph.layout import ImageSegment

from .conftest import get_model, identity_pipeline, tiny_lightkv
from .qwen_oracle import check_layout, expected_tokens, layout_of, non_vision_survive

FAMILY = "qwen2_vl"


def _mixed(model):
    """The examples plus a row with two videos before an image."""
    fam = TINY_MODELS[FAMILY]
    extra = fam.row(
        model, [(1, 4, 4)], videos=[(2, 4, 4), (2, 6, 4)], pre=3, seed=5, videos_first=True
    )
    return fam.collate(fam.examples(model) + [extra])


@pytest.mark.parametrize("generate", [False, True])
def test_layout_is_the_models_vision_tokens(generate):
    model = get_model(FAMILY)
    batch = _mixed(model)
    expected = expected_tokens(model, batch)
    segs = check_layout(layout_of(model, batch, generate), expected)
    # the model's grids: 2x2 merge of the patch grids, one grid per frame
    assert sorted(k for k in segs if k[0] == "video") == [("video", 0), ("video", 1), ("video", 2)]
    assert [len(segs[("video", k)]) for k in range(3)] == [3, 2, 2]
    layout = layout_of(model, batch)
    assert [layout.image_grid[s].tolist() for s in segs[("video", 2)]] == [[3, 2], [3, 2]]
    assert layout.num_videos == 3


def test_video_frames_step_the_temporal_id_by_one():
    """Qwen2-VL's temporal M-RoPE id grows by 1 per frame (no seconds per grid)."""
    model = get_model(FAMILY)
    batch = _mixed(model)
    pos, _ = model.model.get_rope_index(
        batch["input_ids"],
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        batch["video_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    layout = layout_of(model, batch)
    for v in range(layout.num_videos):
        frames = (layout.image_video == v).nonzero().squeeze(1).tolist()
        b = int(layout.image_row[frames[0]])
        times = [int(pos[0, b][layout.image[b] == s].unique().item()) for s in frames]
        assert times == list(range(times[0], times[0] + len(frames)))


def test_positions_without_encoder_outputs_give_the_same_layout():
    """Only 3-D position_ids (no grids, no pre-encoded features): one video per run."""
    model = get_model(FAMILY)
    batch = _mixed(model)
    pos, _ = model.model.get_rope_index(
        batch["input_ids"],
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        batch["video_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    adapter = get_adapter(model)
    padding = batch["attention_mask"] == 0
    inputs = {"input_ids": batch["input_ids"], "position_ids": pos}
    assert adapter.build_layout(inputs, padding) == adapter.build_layout(batch, padding)


def test_markers_survive_and_mixed_batch_is_exact():
    model = get_model(FAMILY)
    batch = _mixed(model)
    ref = model(**batch).logits
    with apply(identity_pipeline(), model) as session:
        out = session.to_prompt_positions(model(**batch).logits)
    valid = batch["attention_mask"].bool()
    assert (out - ref)[valid].abs().max().item() <= 1e-5
    with apply(tiny_lightkv(), model) as session:
        model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert non_vision_survive(session, batch)
    assert int(session.last_prefill.final_layout.vision_mask.sum()) < int(
        session.last_prefill.layout.vision_mask.sum()
    )


def test_frames_that_do_not_add_up_are_refused():
    frames = [ImageSegment(0, 0, (2, 2)), ImageSegment(0, 4, (2, 2))]
    assert [(s.video, s.frame) for s in label_video_frames(frames, [8])] == [(0, 0), (0, 1)]
    with pytest.raises(ValueError, match="do not fit"):
        label_video_frames(frames, [6, 2])
    with pytest.raises(ValueError, match="more video frames"):
        label_video_frames(frames, [4])
    with pytest.raises(ValueError, match="fewer video placeholders"):
        label_video_frames(frames, [12])
    with pytest.raises(ValueError, match="do not fit"):
        label_video_frames([ImageSegment(0, 0, (2, 2)), ImageSegment(1, 0, (2, 2))], [8])


def test_sliding_window_is_refused():
    model = get_model(FAMILY)
    text = model.config.get_text_config()
    text.use_sliding_window = True
    try:
        with pytest.raises(NotImplementedError, match="sliding-window"):
            get_adapter(model)
    finally:
        text.use_sliding_window = False


def test_without_grids_or_positions_is_refused():
    model = get_model(FAMILY)
    batch = _mixed(model)
    with pytest.raises(ValueError, match="need image_grid_thw or 3-D M-RoPE position_ids"):
        get_adapter(model).build_layout({"input_ids": batch["input_ids"]}, None)
