"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): dynamic-resolution grids, video frames.

Like Qwen2.5-VL (`lightkv.adapters.qwen2_5_vl`, whose grid and M-RoPE readers this
adapter reuses): an image of ``image_grid_thw = (t, h, w)`` 14-px patches is ``t * (h / 2)
* (w / 2)`` consecutive ``image_token_id`` placeholders after the 2 x 2 spatial merge, in
(time, row, column) order; a video of ``video_grid_thw = (t, h, w)`` is one run of
``video_token_id`` placeholders holding its ``t`` frames one after the other, each frame
``(h / 2) x (w / 2)`` tokens. Every image and every frame is its own grid; the frames of
one video share a ``video`` label and carry ``frame = 0 .. t-1``. Qwen2-VL's temporal
M-RoPE id steps by 1 per frame (no ``second_per_grid_ts``).

``generate()`` encodes images and videos before the prefill and passes 3-D M-RoPE
``position_ids`` instead of the grids; frames are then read from the temporal / height /
width positions of their tokens, and the videos from the sizes of the pre-encoded video
features (or, without them, one video per run of video placeholders). Surviving tokens
keep their 3-D positions. Pass ``mm_token_type_ids`` (without it transformers falls back
to 1-D positions).

Exact: images, videos and both mixed in one batch, in a forward or generate (greedy, sampling, beam
  search); FlashAttention-2 (2-D padding masks; = the sdpa run under the test stand-in).
Refused: sliding-window attention layers (``use_sliding_window``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..graph.layout import ImageSegment
from .base import token_runs
from .qwen2_5_vl import Qwen25VLAdapter

__all__ = ["Qwen2VLAdapter", "label_video_frames"]


def label_video_frames(
    segments: Sequence[ImageSegment], counts: Sequence[int]
) -> list[ImageSegment]:
    """Give the frame segments of videos (in placeholder order) their video label and frame
    index: video ``k`` is the next ``counts[k]`` tokens' worth of frames, all in one row.

    Raises:
        ValueError: the frames do not add up to the videos, or a video spans two rows.
    """
    out: list[ImageSegment] = []
    it = iter(segments)
    for k, count in enumerate(int(c) for c in counts):
        left, frame, row = count, 0, None
        while left > 0:
            seg = next(it, None)
            if seg is None:
                raise ValueError(
                    f"video {k} ({count} tokens) has fewer video placeholders than its features"
                )
            n = seg.grid[0] * seg.grid[1]
            if n > left or (row is not None and seg.row != row):
                raise ValueError(
                    f"the frames of video {k} ({count} tokens) do not fit its placeholder runs"
                )
            row = seg.row
            out.append(replace(seg, video=k, frame=frame))
            frame, left = frame + 1, left - n
    if next(it, None) is not None:
        raise ValueError(
            f"the prompt has more video frames than the {len(counts)} video(s) describe"
        )
    return out


class Qwen2VLAdapter(Qwen25VLAdapter):
    """Qwen2-VL: one grid per image and per video frame; frames labelled by video."""

    family = "qwen2_vl"
    model_types = ("qwen2_vl",)

    def check_config(self) -> None:
        text = self.config.get_text_config()
        if getattr(text, "use_sliding_window", False):
            raise NotImplementedError(
                f"the {self.family} adapter does not support sliding-window attention layers "
                "(use_sliding_window=True); use a model configured with full attention"
            )

    def build_layout(self, inputs, padding):
        input_ids = inputs["input_ids"]
        segments: list[ImageSegment] = []
        kinds = (
            ("image", self.config.image_token_id, "image_grid_thw"),
            ("video", self.config.video_token_id, "video_grid_thw"),
        )
        m = self._merge()
        for what, token_id, grid_key in kinds:
            placeholders = input_ids == token_id
            if not bool(placeholders.any()):
                continue
            thw = inputs.get(grid_key)
            if thw is not None:
                found = self._segments_from_grids(placeholders, thw, what)
                counts = [int(t) * int(h) * int(w) // (m * m) for t, h, w in thw.tolist()]
            else:
                positions = inputs.get("position_ids")
                if positions is None or positions.dim() != 3 or positions.shape[0] < 3:
                    raise ValueError(
                        f"{self.family} inputs with {what} tokens need {grid_key} or 3-D M-RoPE "
                        "position_ids (pass mm_token_type_ids so that the model builds them)"
                    )
                found = self._segments_from_positions(placeholders, positions[-3:], what)
                counts = self._encoded_counts(inputs, what) if what == "video" else None
                if what == "video" and counts is None:
                    counts = self._video_counts_without_features(placeholders)
            if what == "video":
                found = label_video_frames(found, counts)
            segments += found
        return self.layout_from_segments(input_ids, segments, padding)

    @staticmethod
    def _encoded_counts(inputs: Mapping[str, Any], what: str) -> list[int] | None:
        """Tokens per image / video of the features ``generate()`` encoded before the prefill."""
        encoded = (inputs.get("mm_encoder_outputs") or {}).get(what)
        pooled = getattr(encoded, "pooler_output", None)
        if isinstance(pooled, (list, tuple)):
            return [int(p.shape[0]) for p in pooled]
        return None

    def _video_counts_without_features(self, placeholders: torch.Tensor) -> list[int]:
        """Qwen2-VL keeps each video in one run of placeholders: one video per run."""
        return [length for _, _, length in token_runs(placeholders)]
