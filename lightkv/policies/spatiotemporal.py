"""Spatio-temporal windows: a video's frames are windowed in time as well as in space.

A video is a run of frames (images sharing `VisionLayout.image_video`, ordered by
`VisionLayout.image_frame`). `SpatioTemporalPartitioner` cuts each video into windows of
``frames x rows x cols``: the spatial cut is the schedule's (``windows_per_side`` or
``window_size``, the same on every frame), and time is cut into as many bands as the
schedule has windows per side (or into ``frames``-long bands). With the LLaVA schedule's
4/2/1 windows per side a 16-frame video gets windows of 4 x (h/4) x (w/4), then
8 x (h/2) x (w/2), then the whole video: windows grow in time and space stage by stage.

Inside a window that spans several frames, its frames alternate between destinations and sources
(the 2nd, 4th, ... frame present in the window are sources; ``split: frames``), so a token can merge
into the same place, or a neighbour, of the previous frame when the features say they match: the
temporal redundancy of video. Ranks count the frames still present, so after a stage has merged
every other frame the next stage pairs the survivors. Windows inside one frame and still images use
the grid partitioner's parity split. Tokens never leave their video, their time band or their row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..graph.scatter import scatter_max, segment_rank
from ..graph.windows import MAX_SIDE, Bands, band_index, check_bands, grid_window_local
from .inputs import StageInputs
from .partitioners import Partition, Partitioner

__all__ = ["SpatioTemporalPartitioner"]


@Partitioner.register("spatiotemporal")
@dataclass
class SpatioTemporalPartitioner(Partitioner):
    """Windows of ``frames x rows x cols`` inside each video; 2-D windows elsewhere.

    Attributes:
        frames: frames per window; 0 (default) cuts each video's frames into as many bands
            as the schedule's ``windows_per_side`` (with ``window_size``: 0 means the whole
            video).
        split: ``frames`` (in multi-frame windows, the 2nd, 4th, ... frame present are
            sources, the others destinations; single-frame windows fall back to ``parity``) or
            ``parity`` (alternate in sequence order, as the grid partitioner).
        bands: how a side (and time) is cut: ``proportional`` or ``leading``.
    """

    frames: int = 0
    split: Literal["frames", "parity"] = "frames"
    bands: Bands = "proportional"

    def __post_init__(self) -> None:
        check_bands(self.bands)
        if (
            isinstance(self.frames, bool)
            or not isinstance(self.frames, int)
            or not 0 <= self.frames <= MAX_SIDE
        ):
            # bounded like a window side: 10**30 frames overflowed a tensor at the first stage
            raise ValueError(
                f"frames must be an integer in [0, {MAX_SIDE}] (0: follow the schedule), got "
                f"{self.frames!r}"
            )
        if self.split not in ("frames", "parity"):
            raise ValueError(f"unknown split {self.split!r}; choose 'frames' or 'parity'")

    def _time_band(
        self, inputs: StageInputs, frame: torch.Tensor, length: torch.Tensor
    ) -> torch.Tensor:
        """Band of each frame index on a video of ``length`` frames."""
        if self.frames:
            return torch.div(frame, self.frames, rounding_mode="floor")
        wps = inputs.spec.windows_per_side
        if wps is None:  # window_size: the whole video is one band in time
            return torch.zeros_like(frame)
        return band_index(frame, length.clamp_min(1), wps, self.bands)

    def partition(self, inputs):
        layout, spec = inputs.layout, inputs.spec
        vision = layout.vision_mask
        window = torch.full_like(layout.image, -1)
        is_src = torch.zeros_like(vision)
        if not vision.any():
            return Partition(window, is_src)
        local = grid_window_local(layout, spec.windows_per_side, spec.window_size, self.bands)[
            vision
        ]
        image = layout.image[vision]
        video = layout.image_video[image]
        frame = layout.image_frame[image]
        s, v = layout.num_images, layout.num_videos
        length = torch.zeros(max(v, 1), dtype=torch.long, device=image.device)
        if v:  # frames per video: the largest frame index + 1
            length = scatter_max(frame[video >= 0], video[video >= 0], v)[0] + 1
        in_video = video >= 0
        band = torch.where(in_video, self._time_band(inputs, frame, length[video.clamp_min(0)]), 0)
        group = torch.where(in_video, s + video, image)  # a still image is its own group
        span = int((layout.image_grid[:, 0] * layout.image_grid[:, 1]).max())
        key = (group * (int(frame.max()) + 1) + band) * span + local
        _, ids = torch.unique(key, sorted=True, return_inverse=True)
        window[vision] = ids
        k = int(ids.max()) + 1
        # Rank of each token's frame among the frames present in its window (after earlier
        # stages some frames are gone): sources are the odd ranks.
        f = int(frame.max()) + 1
        pairs, pair = torch.unique(ids * f + frame, sorted=True, return_inverse=True)
        frame_rank = segment_rank(torch.div(pairs, f, rounding_mode="floor"))[pair]
        multi = (scatter_max(frame_rank, ids, k)[0] > 0)[ids]
        parity = segment_rank(ids) % 2 == 0
        src = torch.where(multi, frame_rank % 2 == 1, parity) if self.split == "frames" else parity
        is_src[vision] = src
        return Partition(window, is_src)
