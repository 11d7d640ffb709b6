"""Scatter ops: native backend against plain loops, torch-scatter against native."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lightkv
from lightkv.graph import scatter
from lightkv.graph.scatter import (
    scatter_max,
    scatter_mean,
    scatter_min,
    scatter_sum,
    segment_rank,
    use_backend,
)


@st.composite
def grouped(draw, dtype=torch.float64):
    m = draw(st.integers(0, 40))
    g = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 10_000))
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, g, (m,), generator=gen)
    # small integers make ties likely, which exercises arg tie-breaking
    src = (
        torch.randint(-3, 4, (m, 2), generator=gen).to(dtype)
        if draw(st.booleans())
        else torch.randn(m, 2, generator=gen, dtype=dtype)
    )
    return src, index, g


def loop_reduce(src, index, g, fn, empty):
    out = []
    for i in range(g):
        rows = [src[j] for j in range(len(index)) if index[j] == i]
        out.append(
            fn(torch.stack(rows)) if rows else torch.full(src.shape[1:], empty, dtype=src.dtype)
        )
    return torch.stack(out) if out else src.new_zeros((0, *src.shape[1:]))


@given(grouped())
def test_native_sum_and_mean_match_loops(data):
    src, index, g = data
    with use_backend("native"):
        torch.testing.assert_close(
            scatter_sum(src, index, g), loop_reduce(src, index, g, lambda r: r.sum(0), 0.0)
        )
        torch.testing.assert_close(
            scatter_mean(src, index, g), loop_reduce(src, index, g, lambda r: r.mean(0), 0.0)
        )


@given(grouped())
def test_native_max_min_and_args_match_loops(data):
    src, index, g = data
    with use_backend("native"):
        for fn, ref in ((scatter_max, torch.max), (scatter_min, torch.min)):
            value, arg = fn(src, index, g)
            torch.testing.assert_close(
                value, loop_reduce(src, index, g, lambda r, ref=ref: ref(r, 0).values, 0.0)
            )
            for i in range(g):
                rows = (index == i).nonzero().flatten()
                for d in range(src.shape[1]):
                    if rows.numel() == 0:
                        assert arg[i, d] == -1
                    else:
                        best = ref(src[rows, d])
                        first = rows[(src[rows, d] == best).nonzero().flatten()[0]]
                        assert arg[i, d] == first


@given(st.lists(st.integers(0, 5), max_size=30))
def test_segment_rank_counts_earlier_members_of_the_group(groups):
    rank = segment_rank(torch.tensor(groups, dtype=torch.long))
    assert rank.tolist() == [groups[:i].count(g) for i, g in enumerate(groups)]


def test_bad_index_and_backend_are_clear_errors():
    with pytest.raises(ValueError, match="one entry per row"):
        scatter_sum(torch.ones(3, 2), torch.zeros(2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="unknown scatter backend"):
        with use_backend("cuda-magic"):  # type: ignore[arg-type]
            pass
    if "torch_scatter" not in scatter.available_backends():
        with pytest.raises(ValueError, match="not installed"):
            with use_backend("torch_scatter"):
                pass


@pytest.mark.scatter
@given(grouped(dtype=torch.float32))
def test_torch_scatter_backend_agrees_with_native(torch_scatter_available, data):
    src, index, g = data
    with use_backend("native"):
        ref = [
            scatter_sum(src, index, g),
            scatter_mean(src, index, g),
            *scatter_max(src, index, g),
            *scatter_min(src, index, g),
        ]
    with use_backend("torch_scatter"):
        assert scatter.get_backend() == "torch_scatter"
        got = [
            scatter_sum(src, index, g),
            scatter_mean(src, index, g),
            *scatter_max(src, index, g),
            *scatter_min(src, index, g),
        ]
    for r, o in zip(ref, got):
        assert o.shape == r.shape and o.dtype == r.dtype
        if r.is_floating_point():
            torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-6)
    # arg-reductions: torch-scatter does not specify which tied row wins, so check that
    # both pick empty groups alike and that the row they pick attains the extreme
    for value, arg, ref_arg in ((got[2], got[3], ref[3]), (got[4], got[5], ref[5])):
        assert torch.equal(arg < 0, ref_arg < 0)
        if src.numel():
            picked = src.gather(0, arg.clamp_min(0))
            torch.testing.assert_close(picked[arg >= 0], value[arg >= 0])


@pytest.mark.scatter
def test_stage_results_do_not_depend_on_the_backend(torch_scatter_available):
    from lightkv import ImageSegment, VisionLayout

    layout = VisionLayout.from_segments(
        2, 60, [ImageSegment(0, 3, (6, 7)), ImageSegment(1, 10, (5, 5))]
    )
    gen = torch.Generator().manual_seed(0)
    hidden, xi = torch.randn(2, 60, 8, generator=gen), torch.rand(2, 60, generator=gen)
    pipe = lightkv.load("lightkv")
    out = {}
    for backend in ("native", "torch_scatter"):
        with use_backend(backend):
            out[backend] = pipe.run(hidden, layout, num_layers=32, relevance=xi)
    for a, b in zip(out["native"], out["torch_scatter"]):
        assert torch.equal(a.kept_index, b.kept_index)
        assert torch.equal(a.provenance.owner, b.provenance.owner)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-6, atol=1e-6)


@given(keep=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=4))
def test_right_align_packs_kept_columns_to_the_right_in_order(keep):
    from lightkv.graph.scatter import right_align

    mask = torch.tensor(keep)
    index, column = right_align(mask)
    width = max(sum(r) for r in keep)
    assert index.shape == (len(keep), width)
    for b, row in enumerate(keep):
        kept = [j for j, k in enumerate(row) if k]
        assert (
            index[b].tolist() == [-1] * (width - len(kept)) + kept
        )  # oracle: pad left, keep order
        for new, old in enumerate(index[b].tolist()):
            if old >= 0:
                assert column[b, old] == new
        assert all(column[b, j] == -1 for j, k in enumerate(row) if not k)
