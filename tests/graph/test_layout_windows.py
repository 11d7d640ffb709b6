"""Layouts, windows and the batched bipartite graph."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightkv import ImageSegment, TokenKind, VisionLayout
from lightkv.graph import BipartiteGraph, Provenance, grid_windows, pseudo_square_windows
from tests.strategies import batches


def test_from_segments_marks_kinds_coords_and_newlines():
    lay = VisionLayout.from_segments(
        2,
        12,
        [ImageSegment(0, 1, (2, 3), newline_every=3), ImageSegment(1, 3, (2, 2))],
        padding_mask=torch.tensor([[False] * 12, [True] * 2 + [False] * 10]),
    )
    assert lay.kind[0].tolist() == [0, 1, 1, 1, 2, 1, 1, 1, 2, 0, 0, 0]
    assert lay.coords[0, 5].tolist() == [1, 0]
    assert lay.kind[1].tolist() == [3, 3, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    assert lay.image[1, 3:7].tolist() == [1] * 4
    assert lay.image_grid.tolist() == [[2, 3], [2, 2]]
    assert lay.vision_counts().tolist() == [6, 4]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            dict(batch_size=1, seq_len=5, segments=[ImageSegment(0, 3, (2, 2))]),
            "outside a sequence",
        ),
        (dict(batch_size=1, seq_len=9, segments=[ImageSegment(1, 0, (2, 2))]), "batch row 1"),
        (dict(batch_size=1, seq_len=9, segments=[ImageSegment(0, 0, (0, 2))]), "empty grid"),
        (
            dict(
                batch_size=1,
                seq_len=9,
                segments=[ImageSegment(0, 0, (2, 2)), ImageSegment(0, 2, (1, 2))],
            ),
            "overlaps",
        ),
        (dict(batch_size=0, seq_len=9, segments=[]), "batch_size > 0"),
        (
            dict(batch_size=1, seq_len=9, segments=[ImageSegment(0, 0, (2, 2), newline_every=3)]),
            "newline_every",
        ),
    ],
)
def test_bad_segments_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VisionLayout.from_segments(**kwargs)


def test_mismatched_layout_tensors_are_rejected():
    lay = VisionLayout.from_segments(1, 6, [ImageSegment(0, 1, (2, 2))])
    with pytest.raises(ValueError, match="layout.image has shape"):
        VisionLayout(
            lay.kind, lay.image[:, :3], lay.coords, lay.origin, lay.image_grid, lay.image_row
        )


@given(case=batches(max_side=12), wps=st.integers(1, 6))
def test_grid_windows_are_axis_aligned_rectangles_that_tile_each_image(case, wps):
    lay = case.layout
    win = grid_windows(lay, windows_per_side=wps)
    assert ((win >= 0) == lay.vision_mask).all()
    for w in win.unique().tolist():
        if w < 0:
            continue
        members = (win == w).nonzero()
        assert len({int(lay.image[b, i]) for b, i in members.tolist()}) == 1  # one image, one row
        rc = lay.coords[win == w]
        r0, r1, c0, c1 = rc[:, 0].min(), rc[:, 0].max(), rc[:, 1].min(), rc[:, 1].max()
        assert len(rc) == (r1 - r0 + 1) * (c1 - c0 + 1)  # a full rectangle
    # per image: min(W, h) x min(W, w) windows whose sizes differ by at most one band
    for img, (h, w) in enumerate(lay.image_grid.tolist()):
        ids = win[(lay.image == img) & lay.vision_mask].unique()
        assert len(ids) == min(wps, h) * min(wps, w)


def test_window_size_windows_and_too_large_window_error():
    lay = VisionLayout.from_segments(1, 20, [ImageSegment(0, 0, (4, 5))])
    win = grid_windows(lay, window_size=(2, 2))
    assert win[0, :20].view(4, 5).tolist() == [
        [0, 0, 1, 1, 2],
        [0, 0, 1, 1, 2],
        [3, 3, 4, 4, 5],
        [3, 3, 4, 4, 5],
    ]
    with pytest.raises(ValueError, match="larger than an image grid"):
        grid_windows(lay, window_size=(5, 2))
    with pytest.raises(ValueError, match="exactly one of"):
        grid_windows(lay, windows_per_side=2, window_size=(2, 2))
    with pytest.raises(ValueError, match="positive integer"):
        grid_windows(lay, windows_per_side=0)


def test_pseudo_square_windows_follow_the_reference_packing():
    # 10 tokens -> side 4: rows [0..3], [4..7], [8, 9]; 2 windows per side cut at 2
    lay = VisionLayout.from_segments(1, 10, [ImageSegment(0, 0, (2, 5))])
    win = pseudo_square_windows(lay, 2)
    assert win[0].tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2]


@given(case=batches(), wps=st.integers(1, 3))
def test_bipartite_graph_blocks_and_networkx_export(case, wps):
    from lightkv.policies import GridPartitioner, StageInputs

    part = GridPartitioner().partition(StageInputs.of(case.layout, windows_per_side=wps))
    g = BipartiteGraph.build(part.window, part.is_src)
    assert g.num_nodes == int(case.layout.vision_mask.sum())
    assert int(g.window_size.sum()) == g.num_nodes
    assert torch.equal(g.src_count + g.dst_count, g.window_size)
    nxg = g.to_networkx()
    assert nx.is_bipartite(nxg)
    # edges only inside windows, A to B
    for u, v in nxg.edges:
        assert nxg.nodes[u]["window"] == nxg.nodes[v]["window"]
        assert {nxg.nodes[u]["side"], nxg.nodes[v]["side"]} == {"A", "B"}
    expected_edges = int((g.src_count * g.dst_count).sum())
    assert nxg.number_of_edges() == expected_edges


def test_provenance_composes_and_exports():
    p = Provenance.identity(1, 5)
    p = p.then(torch.tensor([[0, 0, 1, 2, 2]]), 3)  # 1 -> 0, 4 -> 2
    p = p.then(torch.tensor([[0, -1, 1]]), 2)  # token 1 dropped
    assert p.owner.tolist() == [[0, 0, -1, 1, 1]]
    assert p.sizes().tolist() == [[2, 2]]
    g = p.to_networkx()
    assert set(g.successors(("cur", 0, 1))) == {("orig", 0, 3), ("orig", 0, 4)}
    with pytest.raises(ValueError, match="remap covers"):
        p.then(torch.zeros(1, 3, dtype=torch.long), 1)


def test_select_and_row_keep_coordinates_and_renumber_images():
    lay = VisionLayout.from_segments(
        2, 8, [ImageSegment(0, 0, (1, 2)), ImageSegment(1, 1, (2, 2)), ImageSegment(1, 5, (1, 3))]
    )
    sub = lay.select(torch.tensor([[-1, 0, 1], [1, 2, 7]]))
    assert sub.kind.tolist() == [[TokenKind.PAD, 1, 1], [1, 1, 1]]
    assert sub.origin.tolist() == [[-1, 0, 1], [1, 2, 7]]
    assert sub.coords[1, 2].tolist() == [0, 2]
    row1 = lay.row(1)
    assert row1.image_grid.tolist() == [[2, 2], [1, 3]]
    assert row1.image[0, 1:8].tolist() == [0, 0, 0, 0, 1, 1, 1]
