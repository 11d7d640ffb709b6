"""VScan's first stage (local and global scans, then merging) against slow loops written from the
paper's rule, and its two-stage schedule."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv.methods import VScanScan
from lightkv.policies import (
    AllSources,
    CosineDivergence,
    PreLLMThenLayer,
    SizeWeightedMean,
    StageInputs,
    StageSpec,
    average_kept_fraction,
)
from lightkv.policies.counts import kept_count
from lightkv.stage import Stage
from lightkv.testing import check_policy
from tests.strategies import batches


def slow_scan(
    coords: list[tuple[int, int]],
    grid: tuple[int, int],
    xi: list[float],
    keep: int,
    local=0.5,
    tiles=4,
    shallow: list[float] | None = None,
    fill=False,
):
    """Indices (into the image's tokens, sequence order) of the kept tokens: per tile (token
    row ``r`` in band ``floor(r * min(tiles, h) / h)``, the same for columns) the
    ``floor(floor(local * keep) / #tiles)`` most attended by ``shallow`` (default ``xi``), then
    the ``keep - floor(local * keep)`` (with ``fill``: up to ``keep``) most attended of the rest
    by ``xi``; ties to the earliest."""
    h, w = grid
    th, tw = min(tiles, h), min(tiles, w)
    tile_of = [(r * th // h, c * tw // w) for r, c in coords]
    quota = math.floor(local * keep) // (th * tw)
    shallow = xi if shallow is None else shallow
    kept: set[int] = set()
    for tile in sorted(set(tile_of)):
        members = [i for i in range(len(xi)) if tile_of[i] == tile]
        kept |= set(sorted(members, key=lambda i: (-shallow[i], i))[:quota])
    rest = sorted((i for i in range(len(xi)) if i not in kept), key=lambda i: (-xi[i], i))
    kept |= set(rest[: keep - len(kept) if fill else keep - math.floor(local * keep)])
    return kept


def _stage(ratio: float) -> Stage:
    return Stage(
        spec=StageSpec(0, ratio, windows_per_side=1, mode="pre_llm"),
        partitioner=VScanScan(local_layer=None),
        scorer=CosineDivergence(),
        pruner=AllSources(),
        passer=SizeWeightedMean(),
    )


def _images(case):
    """Per image: (row, sequence positions of its vision tokens)."""
    layout = case.layout
    out = []
    for img in range(layout.num_images):
        mine = (layout.image == img) & layout.vision_mask
        row = int(mine.any(1).nonzero()[0])
        out.append((row, mine[row].nonzero().flatten().tolist()))
    return out


@settings(max_examples=60, deadline=None)
@given(
    case=batches(max_side=9),
    ratio=st.sampled_from([0.0, 0.3, 0.7, 5 / 6, 0.95]),
    tiles=st.sampled_from([1, 2, 4]),
    local=st.sampled_from([0.5, 1.0]),
    local_layer=st.sampled_from([None, 5]),
    fill=st.booleans(),
)
def test_the_kept_tokens_are_the_slow_scans(case, ratio, tiles, local, local_layer, fill):
    b, n_seq = case.relevance.shape
    shallow = torch.rand(b, 3, n_seq, generator=torch.Generator().manual_seed(3))
    inputs = StageInputs.of(
        case.layout,
        case.hidden,
        windows_per_side=1,
        removal_ratio=ratio,
        relevance=case.relevance,
        tower={5: shallow},
    )
    scan = VScanScan(local=local, tiles=tiles, local_layer=local_layer, fill=fill)
    part = scan.partition(inputs)
    layout = case.layout
    for img, (row, pos) in enumerate(_images(case)):
        n = len(pos)
        keep = int(kept_count(torch.tensor([n]), ratio)[0])
        grid = tuple(layout.image_grid[img].tolist())
        coords = [tuple(layout.coords[row, p].tolist()) for p in pos]
        xi = [float(case.relevance[row, p]) for p in pos]
        low = None if local_layer is None else [float(shallow[row, :, p].mean()) for p in pos]
        want = slow_scan(coords, grid, xi, keep, local, tiles, low, fill)
        got = {i for i, p in enumerate(pos) if part.window[row, p] >= 0 and not part.is_src[row, p]}
        if keep == n:
            assert all(
                part.window[row, p] < 0 for p in pos
            )  # an image that loses nothing stays out
        else:
            assert got == want


def test_the_local_scan_keeps_every_tile_however_the_attention_is_spread():
    # 24 x 24 at 96 kept: 48 by the local scan, 3 in each 6 x 6 tile, although all attention
    # sits in the top-left corner (a global top-96 would take the corner only)
    from lightkv import ImageSegment, VisionLayout

    layout = VisionLayout.from_segments(1, 578, [ImageSegment(row=0, offset=1, grid=(24, 24))])
    xi = torch.zeros(1, 578, dtype=torch.float64)
    r, c = torch.meshgrid(torch.arange(24), torch.arange(24), indexing="ij")
    xi[0, 1:577] = torch.exp(-(r + c).double().flatten())
    inputs = StageInputs.of(
        layout, torch.randn(1, 578, 4), windows_per_side=1, removal_ratio=5 / 6, relevance=xi
    )
    part = VScanScan(local_layer=None).partition(inputs)
    kept = (part.window[0, 1:577] >= 0) & ~part.is_src[0, 1:577]
    assert int(kept.sum()) == 96
    per_tile = kept.view(4, 6, 4, 6).sum(dim=(1, 3))
    assert bool((per_tile >= 3).all())


@settings(max_examples=30, deadline=None)
@given(case=batches(max_side=8), ratio=st.sampled_from([0.3, 5 / 6]))
def test_every_dropped_token_is_averaged_into_its_most_similar_kept_token(case, ratio):
    inputs = StageInputs.of(
        case.layout, case.hidden, windows_per_side=1, removal_ratio=ratio, relevance=case.relevance
    )
    part = VScanScan(local_layer=None).partition(inputs)
    res = _stage(ratio).run(inputs)
    for row, pos in _images(case):
        kept = [p for p in pos if part.window[row, p] >= 0 and not part.is_src[row, p]]
        dropped = [p for p in pos if part.window[row, p] >= 0 and part.is_src[row, p]]
        groups = {p: [p] for p in kept}
        for d in dropped:
            x = case.hidden[row, d]
            cos = [
                float(torch.dot(x, case.hidden[row, p]) / (x.norm() * case.hidden[row, p].norm()))
                for p in kept
            ]
            groups[kept[max(range(len(kept)), key=lambda i: (cos[i], -i))]].append(d)
        origin = res.layout.origin[row].tolist()
        for p, members in groups.items():
            want = torch.stack([case.hidden[row, m] for m in members]).mean(0)
            torch.testing.assert_close(res.hidden[row, origin.index(p)], want, rtol=1e-9, atol=1e-9)
        assert not set(dropped) & set(origin)


def test_the_partitioner_and_the_schedule_keep_the_contract():
    check_policy(VScanScan)
    check_policy(VScanScan, local=1.0, tiles=2, local_layer=None, fill=True)
    check_policy(PreLLMThenLayer)


@pytest.mark.parametrize("layers, later", [(32, 15), (28, 13), (4, 1), (1, 0)])
def test_the_later_stage_runs_before_the_middle_layer(layers, later):
    stages = PreLLMThenLayer().plan(layers)
    assert [(s.layer, s.mode) for s in stages] == [(0, "pre_llm"), (later, "layer")]
    k0, k1 = 1 / 6, 1 / 3
    want = k0 * ((later + 1) + (layers - later - 1) * k1) / layers
    assert average_kept_fraction(stages, layers) == pytest.approx(want)


def test_the_vscan_preset_keeps_96_then_32_of_576_an_average_of_64():
    import lightkv
    from lightkv import ImageSegment, VisionLayout

    layout = VisionLayout.from_segments(1, 590, [ImageSegment(row=0, offset=5, grid=(24, 24))])
    hidden = torch.randn(1, 590, 16, generator=torch.Generator().manual_seed(0))
    relevance = torch.rand(1, 590, generator=torch.Generator().manual_seed(1))
    shallow = {5: torch.rand(1, 4, 590, generator=torch.Generator().manual_seed(2))}
    pipe = lightkv.load("vscan")
    results = pipe.run(hidden, layout, num_layers=32, relevance=relevance, tower=shallow)
    assert [int(r.layout.vision_counts()[0]) for r in results] == [96, 32]
    with pytest.raises(ValueError, match=r"vision tower's attention at layer\(s\) \[5\]: pass"):
        pipe.run(hidden, layout, num_layers=32, relevance=relevance)
    assert average_kept_fraction(pipe.scheduler.plan(32), 32) * 576 == pytest.approx(64, abs=0.01)


@pytest.mark.parametrize(
    "bad", [{"local": 1.5}, {"tiles": 0}, {"local_layer": -1}, {"local_layer": 2.0}, {"fill": 1}]
)
def test_parameters_are_checked(bad):
    with pytest.raises(ValueError):
        VScanScan(**bad)
