"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): per-frame video segments and DeepStack.

An image of ``image_grid_thw = (t, h, w)`` patches is ``t * (h / 2) * (w / 2)`` consecutive
``image_token_id`` placeholders after the 2 x 2 spatial merge, as in Qwen2-VL
(`lightkv.adapters.qwen2_vl`, which this adapter extends). A video of ``video_grid_thw =
(t, h, w)`` is ``t`` separate frames: the prompt puts a timestamp (``<0.5 seconds>``, text)
and ``<|vision_start|>`` before each frame's ``(h / 2) x (w / 2)`` ``video_token_id``
placeholders and ``<|vision_end|>`` after them, and the model's rope index splits the grid
into ``t`` grids of ``(1, h, w)``, each frame starting its own 3-D M-RoPE block. Every
frame is its own grid, labelled with its video and ``frame = 0 .. t-1``; the timestamps
and markers between frames are text, never merged. During ``generate()`` the videos are
told apart by the sizes of the pre-encoded video features.

DeepStack: the vision tower returns features from ``vision_config.deepstack_visual_indexes``
blocks, and the decoder adds the ``k``-th of them to the hidden states at every image /
video position right after decoder layer ``k`` (layers ``0 .. D-1``). Those additions
address the full, uncompressed sequence, so a stage that compresses at one of those layers
is refused when the session starts (`Qwen3VLAdapter.check_stages`); stages at layer ``D`` or
later see hidden states that already hold every DeepStack feature, and are exact.

Exact: images, videos and both mixed in one batch, with stages after the last DeepStack layer;
  FlashAttention-2 (2-D padding masks; = the sdpa run under the test stand-in).
Refused: a stage at a decoder layer that still receives DeepStack features (layer < D).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .qwen2_vl import Qwen2VLAdapter

__all__ = ["Qwen3VLAdapter", "deepstack_layers"]


def deepstack_layers(config) -> int:
    """``D``: how many decoder layers (``0 .. D-1``) get DeepStack features added after them
    (one per vision block listed in ``deepstack_visual_indexes``)."""
    vision = config.vision_config
    blocks = set(range(int(vision.depth)))
    found = {int(i) for i in (getattr(vision, "deepstack_visual_indexes", None) or ())} & blocks
    return min(len(found), int(config.get_text_config().num_hidden_layers))


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Qwen3-VL: one grid per image and per video frame; no stage before DeepStack ends."""

    family = "qwen3_vl"
    model_types = ("qwen3_vl",)

    def check_stages(self, stages: Sequence[Any]) -> None:
        d = deepstack_layers(self.config)
        # cache stages leave the hidden states alone, so DeepStack is not in their way
        early = sorted(
            int(s.spec.layer) for s in stages if int(s.spec.layer) < d and s.spec.mode != "cache"
        )
        if early:
            raise NotImplementedError(
                "Qwen3-VL adds DeepStack visual features to the hidden states after decoder "
                f"layers 0..{d - 1}, at the uncompressed image positions; the schedule compresses "
                f"at layer {early[0]}, before DeepStack has finished. Schedule every stage at "
                f"layer {d} or later"
            )

    def _video_counts_without_features(self, placeholders: torch.Tensor) -> list[int]:
        raise ValueError(
            "Qwen3-VL inputs with video tokens need video_grid_thw (or generate()'s pre-encoded "
            "video features) to tell which frames form one video: each frame is its own run of "
            "placeholders"
        )
