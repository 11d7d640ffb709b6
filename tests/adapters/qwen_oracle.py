"""Where Qwen2-VL / Qwen3-VL put their vision tokens, from the model's own code only: the
token count of every image and video from its vision tower, every token's (t, h, w) from
its rope index. Shared by ``test_qwen2_vl.py`` and ``test_qwen3_vl.py``."""

from __future__ import annotations

import torch

from lightkv import Pipeline
from lightkv.adapters import apply
from lightkv.graph.layout import TokenKind
from lightkv.policies import ExplicitSchedule
from lightkv.testing.common import IMAGE, VIDEO

NOTHING = Pipeline(scheduler=ExplicitSchedule(layers=(), windows_per_side=()), name="nothing")


def layout_of(model, batch, generate: bool = False):
    """The layout the session builds for ``batch`` in a forward (or in generate's prefill)."""
    with apply(NOTHING, model) as session:
        if generate:
            model.generate(**batch, max_new_tokens=1, do_sample=False)
        else:
            model(**batch)
    return session.last_prefill.layout


def expected_tokens(model, batch) -> dict[tuple[int, int], tuple[str, int, int, int, int]]:
    """``(batch row, position) -> (kind, item, frame, row, col)`` for every vision token.

    ``item`` numbers the images (or videos) of the batch in order; frames are the distinct
    temporal M-RoPE ids of an item's tokens, in order; ``(row, col)`` is the token's
    height / width id minus its frame's smallest.
    """
    ids = batch["input_ids"]
    pos, _ = model.model.get_rope_index(
        ids,
        batch["mm_token_type_ids"],
        batch.get("image_grid_thw"),
        batch.get("video_grid_thw"),
        attention_mask=batch["attention_mask"],
    )
    out = {}
    kinds = (
        ("image", IMAGE, "pixel_values", "image_grid_thw", model.model.get_image_features),
        ("video", VIDEO, "pixel_values_videos", "video_grid_thw", model.model.get_video_features),
    )
    for what, token, pix_key, grid_key, encode in kinds:
        where = (ids == token).nonzero().tolist()
        if grid_key not in batch:
            assert not where
            continue
        with torch.no_grad():
            sizes = [int(p.shape[0]) for p in encode(batch[pix_key], batch[grid_key]).pooler_output]
        assert len(where) == sum(sizes)
        start = 0
        for item, n in enumerate(sizes):
            toks = where[start : start + n]
            start += n
            thw = [tuple(int(pos[k, b, p]) for k in range(3)) for b, p in toks]
            times = list(dict.fromkeys(t for t, _, _ in thw))
            for frame, time in enumerate(times):
                mine = [(bp, x) for bp, x in zip(toks, thw) if x[0] == time]
                h0 = min(x[1] for _, x in mine)
                w0 = min(x[2] for _, x in mine)
                for (b, p), (_, h, w) in mine:
                    out[(b, p)] = (what, item, frame, h - h0, w - w0)
    return out


def check_layout(layout, expected) -> dict[tuple[str, int], list[int]]:
    """Assert ``layout`` marks exactly the expected tokens as vision tokens, one grid per
    image / frame with the expected coordinates, the frames of each video labelled
    ``0 .. T-1`` under one video id. Returns ``(kind, item) -> segment per frame``."""
    vision = {tuple(x) for x in (layout.kind == TokenKind.VISION).nonzero().tolist()}
    assert vision == set(expected)
    assert not (layout.kind == TokenKind.STRUCTURAL).any()
    segments: dict[tuple[str, int], dict[int, int]] = {}
    for (b, p), (what, item, frame, r, c) in expected.items():
        s = int(layout.image[b, p])
        assert layout.coords[b, p].tolist() == [r, c]
        assert segments.setdefault((what, item), {}).setdefault(frame, s) == s
        assert int(layout.image_row[s]) == b
    owners, result = {}, {}
    for (what, item), frames in segments.items():
        segs = [frames[f] for f in range(len(frames))]
        assert len(set(segs)) == len(segs)
        videos = {int(layout.image_video[s]) for s in segs}
        if what == "video":
            assert len(videos) == 1 and videos != {-1}
            assert [int(layout.image_frame[s]) for s in segs] == list(range(len(segs)))
            assert owners.setdefault(videos.pop(), item) == item  # one video id per video
        else:
            assert videos == {-1}
        for s in segs:  # the grid is the frame's extent and holds all its tokens
            toks = layout.image[int(layout.image_row[s])] == s
            rows, cols = layout.image_grid[s].tolist()
            assert int(toks.sum()) == rows * cols
            assert layout.coords[int(layout.image_row[s])][toks].max(0).values.tolist() == [
                rows - 1,
                cols - 1,
            ]
        result[(what, item)] = segs
    return result


def non_vision_survive(session, batch) -> bool:
    """Every valid prompt token that is not a placeholder (text, vision start / end markers,
    Qwen3-VL timestamps) still has its own column after compression."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    keep = mask & (ids != IMAGE) & (ids != VIDEO)
    origin = session.last_prefill.final_layout.origin
    for b in range(ids.shape[0]):
        kept = set(origin[b][origin[b] >= 0].tolist())
        if not set(keep[b].nonzero().squeeze(1).tolist()) <= kept:
            return False
    return True
