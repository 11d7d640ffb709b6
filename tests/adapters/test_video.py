"""Video inside a model: Qwen2.5-VL's video frames reach the stages as frames of one video,
and the spatio-temporal preset merges across them."""

from __future__ import annotations

import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.policies import ExplicitSchedule

FAMILY = TINY_MODELS["qwen2_5_vl"]


def test_video_frames_are_labelled_in_the_layout():
    model = FAMILY.build()
    rows = [
        FAMILY.row(model, [(1, 8, 8)], videos=[(4, 8, 8)], seed=0),
        FAMILY.row(model, 0, videos=[(2, 4, 8)], seed=1),
    ]
    batch = FAMILY.collate(rows)
    pipe = lightkv.load("lightkv-video").with_scheduler(
        ExplicitSchedule(layers=(1,), removal_ratios=(0.0,), windows_per_side=(1,))
    )
    with torch.no_grad(), lightkv.apply(pipe, model, record=True) as session:
        model(**batch)
    lay = session.records[0].layout
    # row 0: an image (one 4x4 grid), then a video of 4 frames (temporal patch 2: 4 grid frames)
    assert lay.image_video.tolist() == [-1, 0, 0, 0, 0, 1, 1]
    assert lay.image_frame.tolist() == [0, 0, 1, 2, 3, 0, 1]
    assert lay.image_grid.tolist() == [[4, 4]] * 5 + [[2, 4]] * 2
    assert lay.num_videos == 2


def test_the_video_preset_merges_frames_inside_the_model_and_generates():
    model = FAMILY.build()
    batch = FAMILY.collate([FAMILY.row(model, 0, videos=[(4, 8, 8)], seed=0)])
    pipe = lightkv.load("lightkv-video").with_scheduler(
        ExplicitSchedule(layers=(1, 2), removal_ratios=(0.5,), windows_per_side=(2, 1))
    )
    with torch.no_grad(), lightkv.apply(pipe, model, record=True) as session:
        out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    report = session.report()
    assert [(s.vision_in, s.vision_out) for s in report.stages] == [(64, 32), (32, 16)]
    first = session.records[0]
    survivors = first.result.layout
    # the first stage paired frames 0-1 and 2-3 of each spatial window: survivors are frames 0 and 2
    assert sorted(set(survivors.frame[survivors.vision_mask].tolist())) == [0, 2]
    assert out.shape[1] == batch["input_ids"].shape[1] + 4
