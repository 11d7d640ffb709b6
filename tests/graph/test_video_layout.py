"""Video in the layout: frames of one video share a video id and carry their temporal index."""

from __future__ import annotations

import pytest
import torch

from lightkv import ImageSegment, TokenKind, VisionLayout


def video_batch() -> VisionLayout:
    # row 0: a still image, then a 3-frame video (2x2 tokens per frame); row 1: a 2-frame video
    segments = [
        ImageSegment(row=0, offset=1, grid=(2, 2)),
        *(
            ImageSegment(row=0, offset=6 + 4 * t, grid=(2, 2), video="clip", frame=t)
            for t in range(3)
        ),
        *(
            ImageSegment(row=1, offset=2 + 4 * t, grid=(2, 2), video="clip", frame=t)
            for t in range(2)
        ),
    ]
    return VisionLayout.from_segments(2, 20, segments)


def test_frames_and_videos_per_image_and_per_token():
    lay = video_batch()
    assert lay.image_video.tolist() == [-1, 0, 0, 0, 1, 1]  # the same label in two rows: two videos
    assert lay.image_frame.tolist() == [0, 0, 1, 2, 0, 1]
    assert lay.num_videos == 2
    assert lay.frame[0, 1:5].tolist() == [0] * 4 and lay.video[0, 1:5].tolist() == [-1] * 4
    assert lay.frame[0, 6:18].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert lay.video[1, 2:10].tolist() == [1] * 8
    assert (lay.frame[lay.kind == TokenKind.TEXT] == -1).all()


def test_select_and_row_keep_the_video_tables():
    lay = video_batch()
    sub = lay.select(torch.tensor([[-1, 6, 10, 14], [2, 6, -1, 3]]))
    assert sub.frame.tolist() == [[-1, 0, 1, 2], [0, 1, -1, 0]]
    alone = lay.row(1)
    assert alone.image_video.tolist() == [0, 0] and alone.image_frame.tolist() == [0, 1]
    assert alone.num_videos == 1
    assert lay.row(0).image_video.tolist() == [-1, 0, 0, 0]


def test_layouts_without_video_are_unchanged_and_compare_by_the_tables():
    plain = VisionLayout.from_segments(1, 8, [ImageSegment(row=0, offset=1, grid=(2, 2))])
    assert (
        plain.image_video.tolist() == [-1]
        and plain.image_frame.tolist() == [0]
        and plain.num_videos == 0
    )
    rebuilt = VisionLayout(
        plain.kind, plain.image, plain.coords, plain.origin, plain.image_grid, plain.image_row
    )
    assert rebuilt == plain
    framed = VisionLayout.from_segments(1, 8, [ImageSegment(row=0, offset=1, grid=(2, 2), video=0)])
    assert framed != plain


def test_bad_frames_are_refused():
    with pytest.raises(ValueError, match="frame 2 but no video"):
        VisionLayout.from_segments(1, 8, [ImageSegment(row=0, offset=1, grid=(2, 2), frame=2)])
    with pytest.raises(ValueError, match="frame must be a non-negative integer"):
        VisionLayout.from_segments(
            1, 8, [ImageSegment(row=0, offset=1, grid=(2, 2), video="v", frame=-1)]
        )
    lay = video_batch()
    with pytest.raises(ValueError, match="image_frame must have one entry per image"):
        VisionLayout(
            lay.kind,
            lay.image,
            lay.coords,
            lay.origin,
            lay.image_grid,
            lay.image_row,
            lay.image_video,
            lay.image_frame[:2],
        )
