"""What a stage gathers, and from where (issue 28: fewer full-size copies per stage): window
blocks straight from the tokens, windows of very different sizes in groups of their own,
merged rows straight from the tokens, the input left as it was, and the finite check on
vision rows only. Each is checked against the plain computation it replaces."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv import ImageSegment, VisionLayout
from lightkv.graph import BipartiteGraph
from lightkv.policies import StageSpec
from lightkv.policies.inputs import StageInputs
from lightkv.policies.scorers import CosineDivergence, L2Divergence
from lightkv.stage import Stage

from .test_divergence_chunks import KeyJS


def _uneven_graph(sizes: list[int], batch: int, seed: int) -> tuple[BipartiteGraph, int]:
    """Windows of the given sizes spread over ``batch`` rows (with tokens outside the graph)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes) + 3
    window = torch.full((batch, n), -1, dtype=torch.long)
    ids = torch.cat([torch.full((s,), w) for w, s in enumerate(sizes)])
    rows = torch.randint(0, batch, (len(sizes),), generator=g)[ids]
    for r in range(batch):
        mine = ids[rows == r]
        pos = torch.randperm(n, generator=g)[: mine.numel()]
        window[r, pos] = mine
    is_src = torch.rand(batch, n, generator=g) < 0.5
    return BipartiteGraph.build(window, is_src), n


sizes_st = st.lists(st.sampled_from([1, 2, 3, 5, 8, 13, 40, 90]), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(sizes=sizes_st, batch=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_window_groups_cover_every_window_once_within_the_waste(sizes, batch, seed):
    graph, _ = _uneven_graph(sizes, batch, seed)
    groups = graph.window_groups(waste=0.25)
    ids = torch.cat(groups).sort().values
    assert torch.equal(ids, torch.arange(graph.num_windows))
    a, b = graph.src_count, graph.dst_count
    for grp in groups:
        padded = grp.numel() * int(a[grp].max()) * int(b[grp].max())
        used = int((a[grp] * b[grp]).sum())
        assert len(groups) == 1 or grp.numel() == 1 or padded <= 1.25 * max(1, used)
    whole = graph.num_windows * int(a.max()) * int(b.max())
    assert (len(groups) == 1) == (whole <= 1.25 * max(1, int((a * b).sum())))


@settings(max_examples=40, deadline=None)
@given(
    sizes=sizes_st,
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    scorer=st.sampled_from([CosineDivergence(), L2Divergence(), KeyJS(features="hidden")]),
)
def test_grouped_matching_is_the_one_call_matching(sizes, batch, seed, scorer):
    graph, n = _uneven_graph(sizes, batch, seed)
    hidden = torch.randn(
        batch, n, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )
    layout = VisionLayout.from_segments(batch, n, [])
    inputs = StageInputs(layout, StageSpec(0, 0.5, windows_per_side=1), hidden)
    grouped = scorer.match(inputs, graph)
    whole = scorer.best_edges(graph, graph.gather(hidden), 2**40)
    assert torch.equal(grouped[0], whole[0])
    torch.testing.assert_close(grouped[1], whole[1], rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    sizes=sizes_st,
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    side=st.sampled_from(["src", "dst"]),
)
def test_token_blocks_are_blocks_of_the_gathered_nodes(sizes, batch, seed, side):
    graph, n = _uneven_graph(sizes, batch, seed)
    values = torch.randn(batch, n, 3, 2).transpose(2, 3)  # not contiguous
    assert torch.equal(
        graph.token_blocks(values, side, fill=-7.0),
        graph.blocks(graph.gather(values), side, fill=-7.0),
    )


def _layout():
    return VisionLayout.from_segments(
        2,
        40,
        [ImageSegment(row=0, offset=2, grid=(4, 6)), ImageSegment(row=1, offset=5, grid=(5, 6))],
    )


@pytest.mark.parametrize("passer", ["relevance_mean", "size_mean", "relevance_size_mean"])
def test_a_stage_leaves_its_inputs_as_they_were(passer):
    from lightkv.policies import MessagePasser

    hidden, xi = torch.randn(2, 40, 8), torch.rand(2, 40)
    before, xi_before = hidden.clone(), xi.clone()
    stage = Stage(StageSpec(0, 0.5, windows_per_side=1), passer=MessagePasser.create(passer))
    out = stage(hidden, _layout(), xi)
    assert torch.equal(hidden, before) and torch.equal(xi, xi_before)
    assert out.hidden.data_ptr() != hidden.data_ptr()


def test_the_finite_check_reads_vision_rows_only_and_survives_an_overflowing_sum():
    layout = _layout()
    hidden = torch.randn(2, 40, 8)
    hidden[0, 0] = float("nan")  # a text token: may hold anything
    hidden[1, 39] = float("inf")
    big = torch.full((8,), 3e38)  # finite, but its sum overflows float32
    hidden[0, 2] = big
    Stage(StageSpec(0, 0.5, windows_per_side=1))(hidden, layout)
    hidden[1, 5, 3] = float("-inf")  # a vision token
    with pytest.raises(ValueError, match="NaN or inf"):
        Stage(StageSpec(0, 0.5, windows_per_side=1))(hidden, layout)
