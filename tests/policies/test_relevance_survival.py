"""Relevance decides who survives: the ``relevance_split`` partitioner and the
``relevance_budget`` pruner (issue 16, item 3), against slow per-window Python oracles."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv import ImageSegment, Stage, TokenKind, VisionLayout
from lightkv.graph import BipartiteGraph
from lightkv.policies import (
    GridPartitioner,
    PruneInputs,
    RelevanceBudget,
    RelevanceSplit,
    SmallestDivergence,
    StageInputs,
    StageSpec,
    allocate_removals,
)
from tests.oracle import window_of
from tests.strategies import batches, ratios

SOURCES = st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0, "ratio"])


def windows_for(layout, wps):
    """Per row: {(image, window): [positions in sequence order]} from plain loops."""
    kind, image, coords = layout.kind.tolist(), layout.image.tolist(), layout.coords.tolist()
    grids = layout.image_grid.tolist()
    rows = []
    for b in range(len(kind)):
        windows: dict[tuple, list[int]] = {}
        for i, k in enumerate(kind[b]):
            if k == TokenKind.VISION:
                h, w = grids[image[b][i]]
                windows.setdefault((image[b][i], window_of(*coords[b][i], h, w, wps)), []).append(i)
        rows.append(windows)
    return rows


def oracle_sources(members, xi, sources, ratio, src_parity):
    """The sources of one window: sort by (ξ, parity split's sources first, position)."""
    n = len(members)
    if sources == "ratio":
        count = max(min(math.floor(n * ratio), n - 1), 0)
    else:
        count = min(max(math.ceil(n * sources - 1e-9), 0), n)
    ranked = sorted(
        range(n), key=lambda r: (xi[members[r]], 0 if r % 2 == src_parity else 1, members[r])
    )
    return {members[r] for r in ranked[:count]}


# ---------------------------------------------------------------- relevance_split


@given(
    case=batches(),
    wps=st.integers(1, 4),
    sources=SOURCES,
    src_parity=st.integers(0, 1),
    ratio=ratios,
)
def test_relevance_split_matches_a_per_window_oracle(case, wps, sources, src_parity, ratio):
    policy = RelevanceSplit(sources=sources, src_parity=src_parity)
    inputs = StageInputs.of(
        case.layout, windows_per_side=wps, removal_ratio=ratio, relevance=case.relevance
    )
    part = policy.partition(inputs)
    grid = GridPartitioner().partition(inputs)
    assert torch.equal(part.window, grid.window)  # the same windows as `grid`
    for b, windows in enumerate(windows_for(case.layout, wps)):
        xi = case.relevance[b].tolist()
        expected = set()
        for members in windows.values():
            expected |= oracle_sources(members, xi, sources, ratio, src_parity)
        assert (
            set(part.is_src[b].logical_and(part.window[b] >= 0).nonzero().flatten().tolist())
            == expected
        )


@given(case=batches(), wps=st.integers(1, 4), uniform=st.sampled_from([None, 1.0, 0.3]))
def test_relevance_split_without_relevance_is_the_parity_split(case, wps, uniform):
    xi = None if uniform is None else torch.full_like(case.relevance, uniform)
    inputs = StageInputs.of(case.layout, windows_per_side=wps, relevance=xi)
    part, grid = RelevanceSplit().partition(inputs), GridPartitioner().partition(inputs)
    inside = grid.window >= 0
    assert torch.equal(part.window, grid.window) and torch.equal(
        part.is_src & inside, grid.is_src & inside
    )


@settings(max_examples=50)
@given(case=batches(), wps=st.integers(1, 4), ratio=ratios)
def test_the_most_relevant_token_of_every_window_survives(case, wps, ratio):
    stage = Stage(StageSpec(0, ratio, windows_per_side=wps), partitioner=RelevanceSplit())
    result = stage(case.hidden, case.layout, case.relevance)
    for b, windows in enumerate(windows_for(case.layout, wps)):
        kept = set(result.kept_index[b][result.kept_index[b] >= 0].tolist())
        xi = case.relevance[b].tolist()
        for members in windows.values():
            assert max(members, key=lambda i: (xi[i], -i)) in kept


@settings(max_examples=50)
@given(case=batches(), wps=st.integers(1, 4), ratio=ratios)
def test_with_sources_ratio_the_survivors_are_each_windows_most_relevant(case, wps, ratio):
    stage = Stage(
        StageSpec(0, ratio, windows_per_side=wps), partitioner=RelevanceSplit(sources="ratio")
    )
    result = stage(case.hidden, case.layout, case.relevance)
    for b, windows in enumerate(windows_for(case.layout, wps)):
        kept = set(result.kept_index[b][result.kept_index[b] >= 0].tolist())
        xi = case.relevance[b].tolist()
        for members in windows.values():
            leave = math.floor(len(members) * ratio) if len(members) > 1 else 0
            by_relevance = sorted(members, key=lambda i: xi[i])
            assert kept & set(members) == set(by_relevance[leave:])


def test_relevance_split_checks_its_parameters():
    for bad in (-0.1, 1.5, "half", True):
        with pytest.raises(ValueError, match="sources"):
            RelevanceSplit(sources=bad)
    with pytest.raises(ValueError, match="bands"):
        RelevanceSplit(bands="diagonal")


# ---------------------------------------------------------------- allocate_removals


def greedy_allocation(ideal, capacity, group, total):
    """One removal at a time, to the window of the group whose ideal is least met (ties:
    the lower window)."""
    given = [0] * len(ideal)
    for g, t in enumerate(total):
        for _ in range(t):
            open_ = [w for w in range(len(ideal)) if group[w] == g and given[w] < capacity[w]]
            best = max(open_, key=lambda w: (ideal[w] - given[w], -w))
            given[best] += 1
    return given


@st.composite
def allocations(draw):
    k = draw(st.integers(0, 8))
    groups = draw(st.integers(1, 3))
    capacity = draw(st.lists(st.integers(0, 5), min_size=k, max_size=k))
    group = draw(st.lists(st.integers(0, groups - 1), min_size=k, max_size=k))
    # few distinct values, so that ties (the hard case) are common
    ideal = draw(
        st.lists(
            st.sampled_from([-1.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.25, 4.0, 7.5]), min_size=k, max_size=k
        )
    )
    total = [
        draw(st.integers(0, sum(c for c, gg in zip(capacity, group) if gg == g)))
        for g in range(groups)
    ]
    return ideal, capacity, group, total


@given(args=allocations())
def test_allocate_removals_matches_the_greedy_oracle(args):
    ideal, capacity, group, total = args
    got = allocate_removals(
        torch.tensor(ideal, dtype=torch.float64),
        torch.tensor(capacity, dtype=torch.long),
        torch.tensor(group, dtype=torch.long),
        torch.tensor(total, dtype=torch.long),
    )
    assert got.tolist() == greedy_allocation(ideal, capacity, group, total)


def test_allocate_removals_rounds_by_largest_remainder():
    got = allocate_removals(
        torch.tensor([1.6, 1.3, 1.1]),
        torch.tensor([5, 5, 5]),
        torch.zeros(3, dtype=torch.long),
        torch.tensor([4]),
    )
    assert got.tolist() == [2, 1, 1]
    # a full window passes the rest on
    got = allocate_removals(
        torch.tensor([6.0, 1.0]),
        torch.tensor([2, 9]),
        torch.zeros(2, dtype=torch.long),
        torch.tensor([7]),
    )
    assert got.tolist() == [2, 5]


# ---------------------------------------------------------------- relevance_budget

PARTITIONERS = {
    "parity": GridPartitioner(),
    "random": GridPartitioner(split="random", seed=2),
    "relevance-0.75": RelevanceSplit(sources=0.75),
}


def per_image_vision(result):
    lay = result.layout
    return torch.bincount(lay.image[lay.vision_mask], minlength=lay.num_images).tolist()


@settings(max_examples=60)
@given(
    case=batches(),
    ratio=ratios,
    wps=st.integers(1, 4),
    strength=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    split=st.sampled_from(sorted(PARTITIONERS)),
    cap=st.sampled_from(["sources", "half"]),
)
def test_relevance_budget_removes_exactly_the_plain_total_per_image(
    case, ratio, wps, strength, split, cap
):
    spec = StageSpec(0, ratio, windows_per_side=wps)
    part = PARTITIONERS[split]
    plain = Stage(spec, partitioner=part, pruner=SmallestDivergence(cap=cap))(
        case.hidden, case.layout, case.relevance
    )
    moved = Stage(spec, partitioner=part, pruner=RelevanceBudget(strength=strength, cap=cap))(
        case.hidden, case.layout, case.relevance
    )
    assert per_image_vision(moved) == per_image_vision(plain)
    row = Stage(
        spec, partitioner=part, pruner=RelevanceBudget(strength=strength, cap=cap, scope="row")
    )(case.hidden, case.layout, case.relevance)
    assert torch.equal(row.layout.vision_counts(), plain.layout.vision_counts())


def budget_oracle(layout, relevance, ratio, wps, strength):
    """Per row, per window (parity split): (members, plain budget, capacity, ideal share, image)."""
    out = []
    for b, windows in enumerate(windows_for(layout, wps)):
        xi = relevance[b].tolist()
        per_image: dict[int, list] = {}
        for (img, _), members in windows.items():
            n, a = len(members), math.ceil(len(members) / 2)
            plain = min(math.floor(n * ratio), a) if n - a > 0 else 0
            capacity = a if n - a > 0 else 0
            per_image.setdefault(img, []).append(
                [members, plain, capacity, sum(xi[i] for i in members) / n]
            )
        for img, wins in per_image.items():
            mean = sum(w[3] * len(w[0]) for w in wins) / sum(len(w[0]) for w in wins)
            shares = [w[1] * (w[3] / mean + 1e-6) ** -strength for w in wins]
            total = sum(w[1] for w in wins)
            for w, share in zip(wins, shares):
                ideal = total * share / sum(shares) if sum(shares) > 0 else 0.0
                out.append((b, img, w[0], w[1], w[2], ideal))
    return out


@settings(max_examples=60)
@given(
    case=batches(),
    ratio=ratios,
    wps=st.integers(1, 4),
    strength=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
)
def test_relevance_budget_is_the_best_rounding_of_its_shares(case, ratio, wps, strength):
    stage = Stage(
        StageSpec(0, ratio, windows_per_side=wps), pruner=RelevanceBudget(strength=strength)
    )
    result = stage(case.hidden, case.layout, case.relevance)
    windows = budget_oracle(case.layout, case.relevance, ratio, wps, strength)
    removed = []
    for b, _img, members, _plain, capacity, _ideal in windows:
        kept = set(result.kept_index[b][result.kept_index[b] >= 0].tolist())
        removed.append(len(set(members) - kept))
        assert 0 <= removed[-1] <= capacity
    for img in {w[1] for w in windows}:
        mine = [i for i, w in enumerate(windows) if w[1] == img]
        assert sum(removed[i] for i in mine) == sum(windows[i][3] for i in mine)
        # no single move of one removal from window v to window w brings both closer to their shares
        for w in mine:
            for v in mine:
                if w != v and removed[w] < windows[w][4] and removed[v] > 0:
                    assert windows[w][5] - removed[w] <= windows[v][5] - (removed[v] - 1) + 1e-9


@given(case=batches(), ratio=ratios, wps=st.integers(1, 4))
def test_relevance_budget_without_strength_or_relevance_is_smallest_divergence(case, ratio, wps):
    spec = StageSpec(0, ratio, windows_per_side=wps)
    plain = Stage(spec)(case.hidden, case.layout, case.relevance)
    for pruner, xi in (
        (RelevanceBudget(strength=0.0), case.relevance),
        (RelevanceBudget(strength=2.0), None),
    ):
        got = Stage(spec, pruner=pruner)(case.hidden, case.layout, xi)
        ref = plain if xi is not None else Stage(spec)(case.hidden, case.layout)
        assert torch.equal(got.kept_index, ref.kept_index) and torch.equal(got.hidden, ref.hidden)


def test_relevant_windows_lose_fewer_tokens():
    layout = VisionLayout.from_segments(1, 68, [ImageSegment(row=0, offset=2, grid=(8, 8))])
    relevance = torch.full((1, 68), 0.1)
    relevance[0, 2:66] = torch.where(
        layout.coords[0, 2:66].amax(-1) < 4, 1.0, 0.1
    )  # the top-left window
    hidden = torch.randn(1, 68, 8, generator=torch.Generator().manual_seed(0))
    spec = StageSpec(0, 0.25, windows_per_side=2)
    split = RelevanceSplit(sources=0.75)  # 12 of 16 tokens per window may leave
    plain = Stage(spec, partitioner=split)(hidden, layout, relevance)
    moved = Stage(spec, partitioner=split, pruner=RelevanceBudget())(hidden, layout, relevance)
    assert int(plain.layout.vision_counts()) == int(moved.layout.vision_counts()) == 64 - 16

    def lost(result):
        kept = result.layout.coords[0][result.layout.vision_mask[0]]
        window = (kept[:, 0] >= 4).long() * 2 + (kept[:, 1] >= 4).long()
        return (16 - torch.bincount(window, minlength=4)).tolist()

    assert lost(plain) == [4, 4, 4, 4]
    assert lost(moved)[0] < 4 < min(lost(moved)[1:]) and sum(lost(moved)) == 16


def test_relevance_budget_needs_the_stage_and_checks_its_parameters():
    layout = VisionLayout.from_segments(1, 6, [ImageSegment(0, 1, (2, 2))])
    inputs = StageInputs.of(layout, windows_per_side=1)
    part = GridPartitioner().partition(inputs)
    graph = BipartiteGraph.build(part.window, part.is_src)
    zeros = torch.zeros(graph.src_slots.shape)
    with pytest.raises(ValueError, match="PruneInputs.stage"):
        RelevanceBudget().select(PruneInputs(graph, zeros, zeros, zeros.long()), 0.5)
    assert (
        RelevanceBudget().select(PruneInputs(graph, zeros, zeros, zeros.long(), inputs), 0.5).sum()
        == 2
    )
    for bad in ({"strength": -1.0}, {"strength": float("inf")}, {"scope": "video"}):
        with pytest.raises(ValueError):
            RelevanceBudget(**bad)
