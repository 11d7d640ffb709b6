"""Qwen3-VL: per-frame video segments (oracle: the model's vision tower and rope index),
timestamps between frames as text, mixed batches, and the DeepStack refusal."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS, qwen3_vl

from lightkv import Pipeline
from lightkv.adapters import apply, get_adapter
from lightkv.adapters.qwen3_vl import Qwen3VLAdapter, deepstack_layers
from lightkv.graph.layout import TokenKind
from lightkv.policies import ExplicitSchedule

from .conftest import get_model, identity_pipeline, tiny_lightkv
from .qwen_oracle import check_layout, expected_tokens, layout_of, non_vision_survive

FAMILY = "qwen3_vl"


def _mixed(model):
    """The examples plus a row with two videos before an image."""
    fam = TINY_MODELS[FAMILY]
    extra = fam.row(
        model, [(1, 4, 4)], videos=[(2, 4, 4), (2, 6, 4)], pre=3, seed=5, videos_first=True
    )
    return fam.collate(fam.examples(model) + [extra])


def _schedule(*layers, ratio=0.5):
    return Pipeline(
        scheduler=ExplicitSchedule(
            layers=layers, windows_per_side=(2,) + (1,) * (len(layers) - 1), removal_ratios=(ratio,)
        ),
        name="s",
    )


@pytest.mark.parametrize("generate", [False, True])
def test_layout_is_the_models_vision_tokens(generate):
    model = get_model(FAMILY)
    batch = _mixed(model)
    segs = check_layout(layout_of(model, batch, generate), expected_tokens(model, batch))
    assert [len(segs[("video", k)]) for k in range(3)] == [3, 2, 2]


def test_each_frame_is_its_own_run_and_mrope_block():
    """A timestamp (text) sits before every frame; each frame's M-RoPE block starts at its
    own position (t = smallest h = smallest w)."""
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
        ends = []
        for s in frames:
            where = (layout.image[b] == s).nonzero().squeeze(1)
            assert torch.equal(where, torch.arange(int(where[0]), int(where[-1]) + 1))
            t, h, w = (pos[k, b, where] for k in range(3))
            assert (t == t[0]).all() and int(t[0]) == int(h.min()) == int(w.min())
            ends.append((int(where[0]), int(where[-1])))
        for (_, last), (first, _) in zip(ends[:-1], ends[1:]):
            between = layout.kind[b, last + 1 : first]
            assert (
                between.numel() >= 3 and (between == TokenKind.TEXT).all()
            )  # timestamp, end / start markers


def test_mixed_batch_is_exact_and_text_survives():
    model = get_model(FAMILY)
    batch = _mixed(model)
    ref = model(**batch).logits
    with apply(identity_pipeline(), model) as session:
        out = session.to_prompt_positions(model(**batch).logits)
    assert (out - ref)[batch["attention_mask"].bool()].abs().max().item() <= 1e-5
    with apply(tiny_lightkv(), model) as session:
        model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert non_vision_survive(session, batch)


def test_video_frames_need_grids_or_encoded_videos():
    model = get_model(FAMILY)
    batch = _mixed(model)
    pos, _ = model.model.get_rope_index(
        batch["input_ids"],
        batch["mm_token_type_ids"],
        batch["image_grid_thw"],
        batch["video_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    with pytest.raises(ValueError, match="to tell which frames form one video"):
        get_adapter(model).build_layout(
            {"input_ids": batch["input_ids"], "position_ids": pos}, None
        )


def test_stage_before_deepstack_ends_is_refused():
    model = get_model(FAMILY)
    assert deepstack_layers(model.config) == 1
    with pytest.raises(NotImplementedError) as err:
        apply(_schedule(0, 2), model)
    msg = str(err.value)
    assert "DeepStack" in msg and "decoder layers 0..0" in msg and "compresses at layer 0" in msg
    assert "at layer 1 or later" in msg
    with pytest.raises(
        NotImplementedError, match="compresses at layer 0"
    ):  # even a stage that removes nothing
        apply(_schedule(0, ratio=0.0), model)
    apply(_schedule(1, 2), model).close()  # from layer D on: accepted


def test_deeper_deepstack_refuses_its_last_layer_and_is_exact_after():
    model = qwen3_vl.build(deepstack=(0, 1), vision_depth=2)
    assert deepstack_layers(model.config) == 2
    with pytest.raises(NotImplementedError, match="layers 0..1.*compresses at layer 1"):
        apply(_schedule(1, 3), model)
    calls = []
    lm = model.model.language_model
    original = lm._deepstack_process
    lm._deepstack_process = lambda h, m, e: calls.append(h.shape[1]) or original(h, m, e)
    try:
        batch = _mixed(model)
        ref = model(**batch).logits
        assert len(calls) == 2  # the model adds DeepStack features after layers 0 and 1
        pipe = Pipeline(
            scheduler=ExplicitSchedule(
                layers=(2, 3), windows_per_side=(2, 1), removal_ratios=(0.0,)
            )
        )
        with apply(pipe, model) as session:
            out = session.to_prompt_positions(model(**batch).logits)
        assert (out - ref)[batch["attention_mask"].bool()].abs().max().item() <= 1e-5
        with apply(_schedule(2, 3), model) as session:
            model.generate(**batch, max_new_tokens=2, do_sample=False)
        assert session.report().layers[3].length < batch["input_ids"].shape[1]
    finally:
        del lm._deepstack_process


def test_check_stages_is_called_by_the_session(monkeypatch):
    """The session hands its stages to the adapter once (the hook Qwen3-VL's refusal uses)."""
    seen = []
    monkeypatch.setattr(Qwen3VLAdapter, "check_stages", lambda self, stages: seen.append(stages))
    session = apply(_schedule(0, 2), get_model(FAMILY))
    assert seen == [session.stages] and [s.spec.layer for s in seen[0]] == [0, 2]
