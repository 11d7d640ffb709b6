"""Spatio-temporal windows: tokens stay inside their row, their video and their time band;
windows are the schedule's spatial windows on every frame; odd frames are sources.

The oracle below computes bands with the written rule (proportional: index ``i`` of ``s``
goes to band ``floor(i * min(W, s) / s)``), independently of `lightkv.graph.windows`.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightkv
from lightkv import ImageSegment, Stage, VisionLayout
from lightkv.policies import SpatioTemporalPartitioner, StageInputs, StageSpec


def band(i: int, size: int, w: int) -> int:
    return i * min(w, size) // size


@st.composite
def video_batches(draw):
    """Rows holding still images and videos (frames of one grid), with text around them."""
    rows = draw(st.integers(1, 3))
    segments, lengths = [], []
    for r in range(rows):
        pos = draw(st.integers(0, 2))
        for item in range(draw(st.integers(0, 3))):
            h, w = draw(st.integers(1, 5)), draw(st.integers(1, 5))
            frames = draw(st.integers(1, 6)) if draw(st.booleans()) else 0
            if frames:
                for t in range(frames):
                    segments.append(
                        ImageSegment(row=r, offset=pos, grid=(h, w), video=item, frame=t)
                    )
                    pos += h * w
            else:
                segments.append(ImageSegment(row=r, offset=pos, grid=(h, w)))
                pos += h * w
            pos += draw(st.integers(0, 2))
        lengths.append(pos + 1)
    n = max(lengths)
    return VisionLayout.from_segments(rows, n, segments)


def oracle_key(lay: VisionLayout, b: int, j: int, w: int):
    """(row, group, time band, window row, window col) of token (b, j), from the definitions."""
    img = int(lay.image[b, j])
    h, wd = lay.image_grid[img].tolist()
    r, c = lay.coords[b, j].tolist()
    video = int(lay.image_video[img])
    if video < 0:
        return (b, "image", img, 0, band(r, h, w), band(c, wd, w))
    frames = int(lay.image_frame[lay.image_video == video].max()) + 1
    return (
        b,
        "video",
        video,
        band(int(lay.image_frame[img]), frames, w),
        band(r, h, w),
        band(c, wd, w),
    )


@settings(max_examples=60, deadline=None)
@given(lay=video_batches(), w=st.integers(1, 3))
def test_windows_are_the_written_spatio_temporal_cells(lay, w):
    part = SpatioTemporalPartitioner().partition(StageInputs.of(lay, windows_per_side=w))
    vision = lay.vision_mask
    assert torch.equal(part.window >= 0, vision)
    tokens = vision.nonzero().tolist()
    keys = {(b, j): oracle_key(lay, b, j, w) for b, j in tokens}
    for b1, j1 in tokens:
        for b2, j2 in tokens:
            same_window = int(part.window[b1, j1]) == int(part.window[b2, j2])
            assert same_window == (keys[b1, j1] == keys[b2, j2])


@settings(max_examples=60, deadline=None)
@given(lay=video_batches(), w=st.integers(1, 3))
def test_every_other_present_frame_is_a_source_where_a_window_spans_frames(lay, w):
    # after a stage some frames are gone: drop a random-looking subset of tokens first
    keep = torch.ones(lay.batch_size, lay.seq_len, dtype=torch.bool)
    keep[:, 1::3] = False
    index = torch.stack([torch.nonzero(row).flatten() for row in keep])
    lay = lay.select(index)
    part = SpatioTemporalPartitioner().partition(StageInputs.of(lay, windows_per_side=w))
    frame = lay.frame
    for k in part.window[part.window >= 0].unique().tolist():
        members = part.window == k
        frames = frame[members].tolist()
        present = sorted(set(frames))
        if len(present) > 1:
            expected = torch.tensor([present.index(f) % 2 == 1 for f in frames])
            assert torch.equal(part.is_src[members], expected)


@settings(max_examples=40, deadline=None)
@given(lay=video_batches(), w=st.integers(1, 3), ratio=st.sampled_from([0.25, 0.5]))
def test_a_stage_merges_only_inside_windows_and_keeps_a_partition(lay, w, ratio):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(lay.batch_size, lay.seq_len, 8, generator=gen, dtype=torch.float64)
    stage = Stage(StageSpec(0, ratio, windows_per_side=w), partitioner=SpatioTemporalPartitioner())
    out = stage(hidden, lay)
    part = SpatioTemporalPartitioner().partition(StageInputs.of(lay, windows_per_side=w))
    owner = out.provenance.owner
    assert (owner >= 0).all()
    for b in range(lay.batch_size):
        for j in range(out.kept_index.shape[1]):
            sources = out.provenance.sources(b, j)
            if len(sources) > 1:
                assert len({int(part.window[b, s]) for s in sources}) == 1
    # per window: min(floor(P * n), |A|) leave when the window has a destination
    removed = int(lay.vision_counts().sum() - out.layout.vision_counts().sum())
    expected = 0
    for k in part.window[part.window >= 0].unique().tolist():
        members = part.window == k
        n, a = int(members.sum()), int(part.is_src[members].sum())
        if n > a:
            expected += min(int(ratio * n), a)
    assert removed == expected


def test_stage_after_stage_keeps_pairing_the_surviving_frames():
    """4/2/1 windows on a 16-frame video: every stage finds sources (frames 1, 3, ... then
    the 2nd, 4th ... surviving frame), as the schedule promises."""
    segments = [
        ImageSegment(row=0, offset=1 + 16 * t, grid=(4, 4), video="clip", frame=t)
        for t in range(16)
    ]
    lay = VisionLayout.from_segments(1, 258, segments)
    pipe = lightkv.load("lightkv-video")
    res = pipe.run(
        torch.randn(1, 258, 8, generator=torch.Generator().manual_seed(0)), lay, num_layers=32
    )
    assert [int(r.layout.vision_counts()[0]) for r in res] == [128, 64, 32]


def test_a_static_video_collapses_onto_its_even_frames():
    """Identical frames: each odd frame merges exactly into the frame before it."""
    frame = torch.randn(16, 8, dtype=torch.float64)
    segments = [
        ImageSegment(row=0, offset=1 + 16 * t, grid=(4, 4), video="clip", frame=t) for t in range(4)
    ]
    lay = VisionLayout.from_segments(1, 66, segments)
    hidden = torch.randn(1, 66, 8, dtype=torch.float64)
    for t in range(4):
        hidden[0, 1 + 16 * t : 17 + 16 * t] = frame
    out = Stage(StageSpec(0, 0.5, windows_per_side=2), partitioner=SpatioTemporalPartitioner())(
        hidden, lay
    )
    assert out.layout.vision_counts().tolist() == [32]
    assert sorted(set(out.layout.frame[0][out.layout.vision_mask[0]].tolist())) == [0, 2]
    for j in range(out.kept_index.shape[1]):
        src = out.provenance.sources(0, j)
        if len(src) == 2:
            assert src[1] - src[0] == 16  # the same place, one frame later


def test_presets_for_video():
    pipe = lightkv.load("lightkv-video")
    assert isinstance(pipe.partitioner, SpatioTemporalPartitioner)
    paper = lightkv.load("lightkv-video-paper")
    assert paper.partitioner.scope == "video"
    segments = [
        ImageSegment(row=0, offset=1 + 64 * t, grid=(8, 8), video=0, frame=t) for t in range(4)
    ]
    lay = VisionLayout.from_segments(1, 260, segments)
    res = paper.run(torch.randn(1, 260, 8), lay, num_layers=32)
    assert [int(r.layout.vision_counts()[0]) for r in res] == [
        128,
        64,
        32,
    ]  # one 16x16 pseudo-square
