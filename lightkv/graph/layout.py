"""Where the vision tokens of a batch sit: the `VisionLayout`.

A layout describes one batch of token sequences ``[B, N]``. Every token has a *kind*
(text, vision, structural, padding); every vision or structural token belongs to one
*image* (an image, a tile or a video frame: anything with its own 2-D grid) and has
``(row, col)`` coordinates on that image's grid. Images are numbered across the whole
batch, so one image table serves every row. The frames of one video are images that share
a video id and carry their temporal index, so spatio-temporal policies can group them.

Layouts are immutable. Compression stages return a new layout for the shorter sequence;
survivors keep their original coordinates and their original sequence index (``origin``),
so later windows are true spatial regions and positions stay consistent.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["TokenKind", "ImageSegment", "VisionLayout"]


class TokenKind(enum.IntEnum):
    """The kind of every token in a layout."""

    TEXT = 0
    """Prompt or answer text: never merged or dropped."""
    VISION = 1
    """A vision token: the only kind a stage may merge or drop."""
    STRUCTURAL = 2
    """A token inside an image that must never be merged (e.g. LLaVA-NeXT row newlines)."""
    PAD = 3
    """Padding or a hole left by compression: carries no information and is masked."""


@dataclass(frozen=True)
class ImageSegment:
    """One image's run of tokens inside one batch row.

    Attributes:
        row: the batch row that holds the image.
        offset: sequence index of the image's first token.
        grid: ``(rows, cols)`` of the image's token grid.
        newline_every: if set, the image is stored row by row with one structural token
            after every ``newline_every`` vision tokens (LLaVA-NeXT, Fuyu). Then the
            segment spans ``rows * (cols + 1)`` sequence positions; otherwise ``rows * cols``.
        video: segments of one batch row with the same ``video`` label are the frames of
            one video (any hashable label; None: a still image or a tile).
        frame: the segment's temporal index inside its video (0 for still images).
    """

    row: int
    offset: int
    grid: tuple[int, int]
    newline_every: int | None = None
    video: object | None = None
    frame: int = 0

    @property
    def length(self) -> int:
        """Number of sequence positions the segment spans."""
        rows, cols = self.grid
        return rows * (cols + 1) if self.newline_every else rows * cols


@dataclass(frozen=True)
class VisionLayout:
    """Token kinds, image membership and grid coordinates for a batch.

    All per-token tensors have shape ``[B, N]`` (``coords``: ``[B, N, 2]``) and live on
    the same device as the hidden states they describe.

    Attributes:
        kind: ``[B, N]`` int64, a `TokenKind` per token.
        image: ``[B, N]`` int64, index into the image table for vision and structural
            tokens, ``-1`` elsewhere.
        coords: ``[B, N, 2]`` int64, ``(row, col)`` on the token's image grid, ``-1``
            for tokens outside images.
        origin: ``[B, N]`` int64, the token's index in the original (uncompressed)
            sequence, ``-1`` for holes created by compression. Position ids follow it.
        image_grid: ``[S, 2]`` int64, ``(rows, cols)`` of each of the ``S`` images.
        image_row: ``[S]`` int64, the batch row that holds each image.
        image_video: ``[S]`` int64, the video each image is a frame of (numbered across
            the batch, ``0 .. V-1``), ``-1`` for still images and tiles. Default: all ``-1``.
        image_frame: ``[S]`` int64, each image's temporal index in its video (0 for still
            images). Default: all 0.
    """

    kind: torch.Tensor
    image: torch.Tensor
    coords: torch.Tensor
    origin: torch.Tensor
    image_grid: torch.Tensor
    image_row: torch.Tensor
    image_video: torch.Tensor = field(default=None)  # type: ignore[assignment]
    image_frame: torch.Tensor = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        s = self.image_row.shape[0] if self.image_row.dim() == 1 else 0
        if self.image_video is None:
            object.__setattr__(
                self,
                "image_video",
                torch.full((s,), -1, dtype=torch.long, device=self.image_row.device),
            )
        if self.image_frame is None:
            object.__setattr__(
                self, "image_frame", torch.zeros(s, dtype=torch.long, device=self.image_row.device)
            )
        if self.kind.dim() != 2:
            raise ValueError(f"layout.kind must be [B, N], got shape {tuple(self.kind.shape)}")
        shape = tuple(self.kind.shape)
        for name in ("image", "origin"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(
                    f"layout.{name} has shape {tuple(getattr(self, name).shape)}, "
                    f"expected {shape} like layout.kind"
                )
        if tuple(self.coords.shape) != shape + (2,):
            raise ValueError(
                f"layout.coords has shape {tuple(self.coords.shape)}, expected {shape + (2,)}"
            )
        if self.image_grid.dim() != 2 or self.image_grid.shape[-1] != 2:
            raise ValueError("layout.image_grid must be [S, 2] (rows, cols) per image")
        if self.image_row.shape != self.image_grid.shape[:1]:
            raise ValueError("layout.image_row must have one entry per image in layout.image_grid")
        for name in ("image_video", "image_frame"):
            if getattr(self, name).shape != self.image_grid.shape[:1]:
                raise ValueError(
                    f"layout.{name} must have one entry per image in layout.image_grid"
                )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_segments(
        cls,
        batch_size: int,
        seq_len: int,
        segments: Sequence[ImageSegment],
        padding_mask: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> VisionLayout:
        """Build a layout from image segments; every other position is text (or padding).

        Args:
            batch_size: ``B``.
            seq_len: ``N``.
            segments: the images, in any order; a row may hold several or none.
            padding_mask: optional ``[B, N]`` bool, True where the position is padding.
            device: where to put the tensors (default: ``padding_mask``'s device or CPU).

        Raises:
            ValueError: a segment outside the sequence, overlapping another segment or
                padding, or with an empty grid.
        """
        if batch_size <= 0 or seq_len <= 0:
            raise ValueError(
                f"a layout needs batch_size > 0 and seq_len > 0, got {batch_size} and {seq_len}"
            )
        if device is None:
            device = padding_mask.device if padding_mask is not None else "cpu"
        kind = torch.full((batch_size, seq_len), int(TokenKind.TEXT), dtype=torch.long)
        image = torch.full((batch_size, seq_len), -1, dtype=torch.long)
        coords = torch.full((batch_size, seq_len, 2), -1, dtype=torch.long)
        if padding_mask is not None:
            if tuple(padding_mask.shape) != (batch_size, seq_len):
                raise ValueError(
                    f"padding_mask has shape {tuple(padding_mask.shape)}, expected "
                    f"{(batch_size, seq_len)}"
                )
            kind[padding_mask.bool().cpu()] = int(TokenKind.PAD)
        grids, rows, videos, frames = [], [], [], []
        video_ids: dict[tuple[int, object], int] = {}
        for index, seg in enumerate(segments):
            h, w = seg.grid
            if h <= 0 or w <= 0:
                raise ValueError(f"image segment {index} has an empty grid {seg.grid}")
            if not 0 <= seg.row < batch_size:
                raise ValueError(
                    f"image segment {index} is in batch row {seg.row}, but B = {batch_size}"
                )
            if seg.offset < 0 or seg.offset + seg.length > seq_len:
                raise ValueError(
                    f"image segment {index} spans positions "
                    f"{seg.offset}..{seg.offset + seg.length - 1}, outside a sequence of length "
                    f"{seq_len}"
                )
            span = slice(seg.offset, seg.offset + seg.length)
            if (image[seg.row, span] >= 0).any() or (kind[seg.row, span] == TokenKind.PAD).any():
                raise ValueError(
                    f"image segment {index} overlaps another image or padding in row {seg.row}"
                )
            r = torch.arange(h).repeat_interleave(w + (1 if seg.newline_every else 0))
            c = torch.arange(w + (1 if seg.newline_every else 0)).repeat(h)
            seg_kind = torch.full((seg.length,), int(TokenKind.VISION), dtype=torch.long)
            if seg.newline_every:
                if seg.newline_every != w:
                    raise ValueError(
                        f"image segment {index}: newline_every={seg.newline_every} must equal the "
                        f"grid width {w}"
                    )
                seg_kind[c == w] = int(TokenKind.STRUCTURAL)
            kind[seg.row, span] = seg_kind
            image[seg.row, span] = index
            coords[seg.row, span, 0] = r
            coords[seg.row, span, 1] = c
            if isinstance(seg.frame, bool) or not isinstance(seg.frame, int) or seg.frame < 0:
                raise ValueError(
                    f"image segment {index}: frame must be a non-negative integer, got "
                    f"{seg.frame!r}"
                )
            if seg.video is None and seg.frame:
                raise ValueError(
                    f"image segment {index} has frame {seg.frame} but no video; give video=<label>"
                )
            grids.append((h, w))
            rows.append(seg.row)
            videos.append(
                -1
                if seg.video is None
                else video_ids.setdefault((seg.row, seg.video), len(video_ids))
            )
            frames.append(seg.frame)
        origin = torch.arange(seq_len).expand(batch_size, seq_len).clone()
        image_grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 2)
        image_row = torch.tensor(rows, dtype=torch.long)
        image_video = torch.tensor(videos, dtype=torch.long)
        image_frame = torch.tensor(frames, dtype=torch.long)
        return cls(kind, image, coords, origin, image_grid, image_row, image_video, image_frame).to(
            device
        )

    def to(self, device: torch.device | str) -> VisionLayout:
        """The same layout on another device."""
        return VisionLayout(*(t.to(device) for t in self._tensors()))

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.kind,
            self.image,
            self.coords,
            self.origin,
            self.image_grid,
            self.image_row,
            self.image_video,
            self.image_frame,
        )

    # ------------------------------------------------------------------ views
    @property
    def batch_size(self) -> int:
        """``B``, the number of rows."""
        return self.kind.shape[0]

    @property
    def seq_len(self) -> int:
        """``N``, the sequence length (padding and holes included)."""
        return self.kind.shape[1]

    @property
    def num_images(self) -> int:
        """``S``, the number of images (tiles, frames) across the batch."""
        return self.image_grid.shape[0]

    @property
    def num_videos(self) -> int:
        """``V``, the number of videos across the batch."""
        return int(self.image_video.max()) + 1 if self.num_images else 0

    @property
    def frame(self) -> torch.Tensor:
        """``[B, N]`` int64: the temporal index of each token's image in its video (0 for
        still images), ``-1`` for tokens outside images."""
        if not self.num_images:
            return torch.full_like(self.image, -1)
        return torch.where(self.image >= 0, self.image_frame[self.image.clamp_min(0)], -1)

    @property
    def video(self) -> torch.Tensor:
        """``[B, N]`` int64: the video each token belongs to, ``-1`` outside videos."""
        if not self.num_images:
            return torch.full_like(self.image, -1)
        return torch.where(self.image >= 0, self.image_video[self.image.clamp_min(0)], -1)

    @property
    def device(self) -> torch.device:
        """Where the layout's tensors live."""
        return self.kind.device

    @property
    def vision_mask(self) -> torch.Tensor:
        """``[B, N]`` bool: tokens a stage may merge or drop."""
        return self.kind == TokenKind.VISION

    @property
    def text_mask(self) -> torch.Tensor:
        """``[B, N]`` bool: text tokens."""
        return self.kind == TokenKind.TEXT

    @property
    def valid_mask(self) -> torch.Tensor:
        """``[B, N]`` bool: every token that is not padding or a hole."""
        return self.kind != TokenKind.PAD

    def vision_counts(self) -> torch.Tensor:
        """``[B]`` number of vision tokens per row."""
        return self.vision_mask.sum(dim=1)

    def select(self, index: torch.Tensor) -> VisionLayout:
        """The layout of a gathered sequence.

        Args:
            index: ``[B, M]`` int64 positions into this layout's sequence; ``-1`` makes a
                hole (kind PAD, no image, no origin).
        """
        hole = index < 0
        safe = index.clamp_min(0)

        def take(t: torch.Tensor, fill: int) -> torch.Tensor:
            if t.dim() == 3:
                out = t.gather(1, safe.unsqueeze(-1).expand(-1, -1, t.shape[-1]))
                return out.masked_fill(hole.unsqueeze(-1), fill)
            return t.gather(1, safe).masked_fill(hole, fill)

        return VisionLayout(
            kind=take(self.kind, int(TokenKind.PAD)),
            image=take(self.image, -1),
            coords=take(self.coords, -1),
            origin=take(self.origin, -1),
            image_grid=self.image_grid,
            image_row=self.image_row,
            image_video=self.image_video,
            image_frame=self.image_frame,
        )

    def row(self, b: int) -> VisionLayout:
        """The layout of batch row ``b`` alone, with its images renumbered from 0 and
        leading holes/padding created by compression kept as they are."""
        keep = self.image_row == b
        new_id = torch.full((self.num_images,), -1, dtype=torch.long, device=self.device)
        new_id[keep] = torch.arange(int(keep.sum()), device=self.device)
        image = self.image[b : b + 1]
        if self.num_images:
            image = torch.where(image >= 0, new_id[image.clamp_min(0)], image)
        video = self.image_video[keep]
        if video.numel() and bool((video >= 0).any()):
            _, compact = torch.unique(video[video >= 0], sorted=True, return_inverse=True)
            video = video.clone()
            video[video >= 0] = compact
        return VisionLayout(
            kind=self.kind[b : b + 1],
            image=image,
            coords=self.coords[b : b + 1],
            origin=self.origin[b : b + 1],
            image_grid=self.image_grid[keep],
            image_row=torch.zeros(int(keep.sum()), dtype=torch.long, device=self.device),
            image_video=video,
            image_frame=self.image_frame[keep],
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, VisionLayout):
            return NotImplemented
        return all(
            a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
            for a, b in zip(self._tensors(), other._tensors())
        )

    __hash__ = None  # type: ignore[assignment]
