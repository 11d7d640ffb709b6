"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): dynamic-resolution grids, video frames.

An image of ``image_grid_thw = (t, h, w)`` 14-px patches becomes ``t`` grids of
``(h / m) x (w / m)`` tokens after the ``m x m`` spatial merge (``m = 2``); a video of
``video_grid_thw = (t, h, w)`` becomes ``t`` such frames, one after the other. Every
image or frame is its own grid in the layout, so windows never mix frames.

``generate()`` encodes images before the prefill and passes the 3-D M-RoPE
``position_ids`` instead of the grids; then each frame is read from the positions of its
tokens (temporal / height / width components), which is what the model's rotary
embedding sees. Surviving tokens keep these 3-D positions. The frames of a video carry
their video and frame index (`lightkv.graph.VisionLayout.image_frame`), for
spatio-temporal windows.

Exact: identity (nothing removed = unhooked logits, prefill and decode), batch rows alone = in a
  padded batch, sdpa, eager and FlashAttention-2 (2-D padding masks; = the sdpa run under the test
  stand-in), images and videos mixed in one batch, 3-D M-RoPE positions, beam search.
Refused: sliding-window attention layers (``use_sliding_window``).
"""

from __future__ import annotations

import torch

from ..graph.layout import ImageSegment
from .base import Adapter, place_images, token_runs

__all__ = ["Qwen25VLAdapter"]


class Qwen25VLAdapter(Adapter):
    """Qwen2.5-VL: one grid per image and per video frame."""

    family = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)

    def check_config(self) -> None:
        text = self.config.get_text_config()
        if getattr(text, "use_sliding_window", False):
            raise NotImplementedError(
                "the qwen2_5_vl adapter does not support sliding-window attention layers"
            )

    def _merge(self) -> int:
        return int(self.config.vision_config.spatial_merge_size)

    def build_layout(self, inputs, padding):
        input_ids = inputs["input_ids"]
        segments: list[ImageSegment] = []
        kinds = (
            ("image", self.config.image_token_id, "image_grid_thw"),
            ("video", self.config.video_token_id, "video_grid_thw"),
        )
        for what, token_id, grid_key in kinds:
            placeholders = input_ids == token_id
            if not bool(placeholders.any()):
                continue
            thw = inputs.get(grid_key)
            if thw is not None:
                segments += self._segments_from_grids(placeholders, thw, what)
                continue
            positions = inputs.get("position_ids")
            if positions is None or positions.dim() != 3 or positions.shape[0] < 3:
                raise ValueError(
                    f"Qwen2.5-VL inputs with {what} tokens need {grid_key} or 3-D M-RoPE "
                    "position_ids (pass mm_token_type_ids so that the model builds them)"
                )
            segments += self._segments_from_positions(placeholders, positions[-3:], what)
        return self.layout_from_segments(input_ids, segments, padding)

    def _segments_from_grids(
        self, placeholders, thw: torch.Tensor, what: str
    ) -> list[ImageSegment]:
        m = self._merge()
        frames = []  # (grid, video label, frame index)
        for v, (t, h, w) in enumerate(thw.tolist()):
            label = (what, v) if what == "video" else None
            frames += [
                ((int(h) // m, int(w) // m), label, k if label else 0) for k in range(int(t))
            ]
        places = place_images(placeholders, [h * w for (h, w), _, _ in frames], what)
        return [
            ImageSegment(row=r, offset=o, grid=g, video=label, frame=k)
            for (r, o), (g, label, k) in zip(places, frames)
        ]

    @staticmethod
    def _segments_from_positions(
        placeholders, positions: torch.Tensor, what: str
    ) -> list[ImageSegment]:
        pos = positions.cpu()
        if pos.shape[1] != placeholders.shape[0]:
            pos = pos.expand(-1, placeholders.shape[0], -1)
        segments = []
        for run, (row, start, length) in enumerate(token_runs(placeholders)):
            label = (what, run) if what == "video" else None  # one contiguous run per video
            frame = 0
            t, h, w = (pos[k, row, start : start + length] for k in range(3))
            cut = (torch.diff(t) != 0).nonzero().squeeze(1) + 1
            bounds = [0] + cut.tolist() + [length]
            for a, b in zip(bounds[:-1], bounds[1:]):
                rows = int(h[a:b].max() - h[a:b].min()) + 1
                cols = int(w[a:b].max() - w[a:b].min()) + 1
                n = b - a
                if n % (rows * cols):
                    raise ValueError(
                        f"cannot read a {what} grid from the M-RoPE positions of its tokens"
                    )
                for k in range(n // (rows * cols)):  # frames that share a temporal position
                    off = a + k * rows * cols
                    if not (int(h[off]) == int(h[a:b].min()) and int(w[off]) == int(w[a:b].min())):
                        raise ValueError(
                            f"the M-RoPE positions of a {what} are not in raster order"
                        )
                    segments.append(
                        ImageSegment(
                            row=row,
                            offset=start + off,
                            grid=(rows, cols),
                            video=label,
                            frame=frame if label else 0,
                        )
                    )
                    frame += 1
        return segments
