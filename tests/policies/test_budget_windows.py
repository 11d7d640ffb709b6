"""The window layout as a function of the budget (`GridPartitioner.min_kept_per_window`):
the rule's boundary against an oracle written from its definition, and ``lightkv-cover``
unchanged at 22% kept and above."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightkv
from lightkv import ImageSegment, VisionLayout
from lightkv.policies import GridPartitioner, Prompt, StageInputs
from tests.strategies import batches


def oracle_side(h: int, w: int, ratio: float, top: int, k_min: int) -> int:
    """Windows per side of an ``h x w`` image from the rule's text: the largest ``v <= top``
    whose ``min(v, h) * min(v, w)`` windows hold ``>= k_min`` kept tokens each on average,
    1 where none does."""
    n = h * w
    kept = max(1, n - math.floor(n * ratio + 1e-9))
    fits = [v for v in range(1, top + 1) if kept >= k_min * min(v, h) * min(v, w)]
    return max(fits, default=1)


def groups_by_image(layout: VisionLayout, window: torch.Tensor) -> dict[int, set]:
    """Per image, its tokens grouped by window: a set of frozensets of ``(row, col)``."""
    out: dict[int, dict[int, set]] = {}
    vision = layout.vision_mask
    for b, n in zip(*torch.nonzero(vision, as_tuple=True)):
        img = int(layout.image[b, n])
        cell = tuple(layout.coords[b, n].tolist())
        out.setdefault(img, {}).setdefault(int(window[b, n]), set()).add(cell)
    return {i: {frozenset(c) for c in g.values()} for i, g in out.items()}


def expected_groups(h: int, w: int, v: int) -> set:
    """The proportional bands' windows of an ``h x w`` grid at ``v`` windows per side."""
    vr, vc = min(v, h), min(v, w)
    cells: dict[tuple[int, int], set] = {}
    for r in range(h):
        for c in range(w):
            cells.setdefault((r * vr // h, c * vc // w), set()).add((r, c))
    return {frozenset(s) for s in cells.values()}


@settings(max_examples=60, deadline=None)
@given(
    case=batches(max_images=3, max_side=12),
    top=st.integers(1, 5),
    k_min=st.integers(0, 40),
    ratio=st.sampled_from([0.0, 0.3, 0.5, 0.78, 0.875, 0.89, 0.95, 0.97]),
)
def test_windows_follow_the_rule_image_by_image(case, top, k_min, ratio):
    layout = case.layout
    inputs = StageInputs.of(layout, case.hidden, windows_per_side=top, removal_ratio=ratio)
    part = GridPartitioner(split="all_src", min_kept_per_window=k_min).partition(inputs)
    got = groups_by_image(layout, part.window)
    for i, (h, w) in enumerate(layout.image_grid.tolist()):
        v = oracle_side(h, w, ratio, top, k_min) if k_min else top
        assert got[i] == expected_groups(h, w, v), (i, h, w, v)


@pytest.mark.parametrize(
    "kept,k_min,side",
    [(32, 8, 2), (31, 8, 1), (29, 7, 2), (29, 8, 1), (57, 14, 2), (57, 15, 1), (1, 1, 1)],
)
def test_boundary_on_a_16x16_image(kept, k_min, side):
    """Exactly at ``kept = K * 4`` the 2 x 2 windows stay; one kept token fewer, one window."""
    layout = VisionLayout.from_segments(1, 260, [ImageSegment(0, 2, (16, 16))])
    ratio = 1.0 - kept / 256
    inputs = StageInputs.of(layout, None, windows_per_side=2, removal_ratio=ratio)
    grid = GridPartitioner(split="all_src", min_kept_per_window=k_min)
    assert grid.sides(layout, 2, ratio).tolist() == [side]
    assert int(grid.partition(inputs).window.max()) + 1 == side * side


def test_off_and_bad_values():
    layout = VisionLayout.from_segments(1, 70, [ImageSegment(0, 2, (8, 8))])
    inputs = StageInputs.of(layout, None, windows_per_side=4, removal_ratio=0.97)
    off = GridPartitioner(split="all_src").partition(inputs)
    assert int(off.window.max()) + 1 == 16
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_kept_per_window must be a non-negative"):
            GridPartitioner(min_kept_per_window=bad)
    sized = StageInputs.of(layout, None, window_size=(4, 4), removal_ratio=0.5)
    with pytest.raises(ValueError, match="needs the schedule's windows_per_side"):
        GridPartitioner(min_kept_per_window=4).partition(sized)


def _kept(pipe, layout, hidden, prompt) -> list[list[int]]:
    (res,) = pipe.run(hidden, layout, num_layers=12, prompt=prompt)
    return res.kept_index.tolist()


@pytest.mark.parametrize("grids", [[(16, 16)], [(24, 24)], [(12, 12), (24, 24), (24, 24)]])
def test_cover_unchanged_at_22_percent_and_above(grids):
    """The shipped K changes nothing where every window keeps at least K tokens: at 22%
    and above on images of 12 x 12 tokens or more (Scenes 16 x 16, LLaVA 24 x 24, a
    LLaVA-NeXT-like base view beside its tiles), the kept sets equal the 2 x 2 layout's."""
    k_min = lightkv.load("lightkv-cover").partitioner.min_kept_per_window
    assert k_min > 0
    segs, pos = [], 3
    for g in grids:
        segs.append(ImageSegment(0, pos, g))
        pos += g[0] * g[1]
    n = pos + 8  # the question after the images
    layout = VisionLayout.from_segments(1, n, segs)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, n, 16, generator=gen)
    prompt = Prompt(torch.arange(n).unsqueeze(0))
    for t in (0.22, 0.3, 0.55):
        pipe = lightkv.load("lightkv-cover", kept_fraction=t)
        before = replace(pipe, partitioner=replace(pipe.partitioner, min_kept_per_window=0))
        assert _kept(pipe, layout, hidden, prompt) == _kept(before, layout, hidden, prompt)


def test_cover_is_one_window_when_the_budget_is_low():
    """At 5% of a 16 x 16 image (13 kept, 3.25 per window) the shipped rule selects in one
    window: the same tokens as the one-window (``global``) partitioner."""
    from lightkv.policies import Partitioner

    layout = VisionLayout.from_segments(1, 270, [ImageSegment(0, 2, (16, 16))])
    hidden = torch.randn(1, 270, 16, generator=torch.Generator().manual_seed(3))
    prompt = Prompt(torch.arange(270).unsqueeze(0))
    pipe = lightkv.load("lightkv-cover", kept_fraction=0.05)
    glob = replace(pipe, partitioner=Partitioner.create("global", split="all_src"))
    assert _kept(pipe, layout, hidden, prompt) == _kept(glob, layout, hidden, prompt)


def test_whole_image_spatial_applies_to_whole_image_windows_only():
    """In one window per image the grid distance's weight is ``whole_image_spatial``
    (the same picks as ``spatial`` set to it); in 2 x 2 windows it changes nothing."""
    from lightkv.policies import Partitioner

    layout = VisionLayout.from_segments(
        1, 300, [ImageSegment(0, 2, (16, 16)), ImageSegment(0, 260, (6, 6))]
    )
    hidden = torch.randn(1, 300, 16, generator=torch.Generator().manual_seed(5))
    prompt = Prompt(torch.arange(300).unsqueeze(0))
    for t in (0.05, 0.22):
        pipe = lightkv.load("lightkv-cover", kept_fraction=t)
        assert pipe.pruner.whole_image_spatial == 0.0 and pipe.pruner.spatial > 0
        plain = replace(pipe, pruner=replace(pipe.pruner, whole_image_spatial=None))
        if t == 0.05:  # both images are one window each: no grid distance anywhere
            glob = Partitioner.create("global", split="all_src")
            ref = replace(pipe, partitioner=glob, pruner=replace(plain.pruner, spatial=0.0))
        else:  # 2 x 2 windows everywhere (6 x 6 keeps 8, 2 per window: one window)
            ref = plain
        got = _kept(pipe, layout, hidden, prompt)
        if t == 0.05:
            assert got == _kept(ref, layout, hidden, prompt)
        else:
            # the 16 x 16 image's picks are the plain ones; the 6 x 6 image is one window,
            # where the grid distance is off
            first = [i for i in got[0] if 2 <= i < 258]
            assert first == [i for i in _kept(plain, layout, hidden, prompt)[0] if 2 <= i < 258]
    with pytest.raises(ValueError, match="whole_image_spatial must be None or a finite"):
        replace(lightkv.load("lightkv-cover").pruner, whole_image_spatial=-1.0)
