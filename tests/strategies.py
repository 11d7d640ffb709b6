"""Hypothesis strategies shared by the tests: random batches of text and images."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from lightkv import ImageSegment, VisionLayout


@dataclass
class Case:
    """A random batch: layout, float64 hidden states and relevance."""

    layout: VisionLayout
    hidden: torch.Tensor
    relevance: torch.Tensor
    segments: list[ImageSegment]


@st.composite
def batches(draw, max_rows=3, max_images=3, max_side=9, newlines=True, padding=True, dim=6):
    """Random batches: rows of text and images (any grid shape), optional row newlines,
    left padding to the longest row."""
    rows = draw(st.integers(1, max_rows))
    row_segments, lengths = [], []
    for b in range(rows):
        pos, segs = draw(st.integers(0, 3)), []
        for _ in range(draw(st.integers(0, max_images))):
            h, w = draw(st.integers(1, max_side)), draw(st.integers(1, max_side))
            nl = w if (newlines and draw(st.booleans())) else None
            seg = ImageSegment(b, pos, (h, w), newline_every=nl)
            segs.append(seg)
            pos += seg.length + draw(st.integers(0, 2))
        pos += draw(st.integers(1, 3))  # the question after the image(s)
        row_segments.append(segs)
        lengths.append(pos)
    n = max(lengths)
    pad = torch.zeros(rows, n, dtype=torch.bool)
    segments = []
    for b, segs in enumerate(row_segments):
        shift = n - lengths[b] if padding else 0
        pad[b, :shift] = True
        if not padding:
            pad[b, lengths[b] :] = True
        segments += [ImageSegment(s.row, s.offset + shift, s.grid, s.newline_every) for s in segs]
    layout = VisionLayout.from_segments(rows, n, segments, padding_mask=pad)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, n, dim, generator=gen, dtype=torch.float64)
    relevance = torch.rand(rows, n, generator=gen, dtype=torch.float64) + 0.05
    return Case(layout, hidden, relevance, segments)


ratios = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.7, 0.9, 0.99])
