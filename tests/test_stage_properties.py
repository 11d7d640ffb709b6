"""Invariants of one compression stage over random batches (hypothesis)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightkv
from lightkv import Stage, TokenKind
from lightkv.policies import (
    CosineDivergence,
    DropMessages,
    GlobalPartitioner,
    GridPartitioner,
    L2Divergence,
    LowestRelevance,
    RandomPruner,
    RelevanceAwareDivergence,
    RelevanceBudget,
    RelevanceSizeWeightedMean,
    RelevanceSplit,
    SizeWeightedMean,
    StageInputs,
    StageSpec,
)
from tests.oracle import window_of
from tests.strategies import batches, ratios

MERGING = {
    "lightkv": dict(),
    "checkerboard": dict(partitioner=GridPartitioner(split="checkerboard")),
    "random-split": dict(partitioner=GridPartitioner(split="random", seed=3)),
    "l2": dict(scorer=L2Divergence()),
    "relevance-aware": dict(pruner=RelevanceAwareDivergence(weight=1.0)),
    "size-mean": dict(passer=SizeWeightedMean()),
    "relevance-split": dict(partitioner=RelevanceSplit(sources=0.75)),
    "relevance-budget": dict(partitioner=RelevanceSplit(sources="ratio"), pruner=RelevanceBudget()),
    "relevance-size-mean": dict(passer=RelevanceSizeWeightedMean()),
}


def promised_vision_count(layout, ratio, wps, split="parity"):
    """Vision tokens a grid-window stage promises to keep, counted with plain loops."""
    total = 0
    kind, image, coords = layout.kind.tolist(), layout.image.tolist(), layout.coords.tolist()
    grids = layout.image_grid.tolist()
    for b in range(len(kind)):
        windows = {}
        for i, k in enumerate(kind[b]):
            if k == TokenKind.VISION:
                h, w = grids[image[b][i]]
                key = (image[b][i], window_of(*coords[b][i], h, w, wps))
                windows[key] = windows.get(key, 0) + 1
        for n in windows.values():
            a = math.ceil(n / 2)
            removed = min(math.floor(ratio * n), a) if n - a > 0 else 0
            total += n - removed
    return total


def strip(result, b):
    keep = result.kept_index[b] >= 0
    return result.kept_index[b][keep], result.hidden[b][keep]


# Policies that keep the default stage's counts: the same sources per window, the same total.
SAME_COUNTS = {
    "lightkv": dict(),
    "relevance-split": dict(partitioner=RelevanceSplit()),
    "relevance-budget": dict(pruner=RelevanceBudget(strength=2.0)),
    "relevance-size-mean": dict(passer=RelevanceSizeWeightedMean()),
}


@pytest.mark.parametrize("variant", sorted(SAME_COUNTS))
@given(case=batches(), ratio=ratios, wps=st.integers(1, 5))
def test_counts_equal_what_the_schedule_promises(variant, case, ratio, wps):
    stage = Stage(StageSpec(0, ratio, windows_per_side=wps), **SAME_COUNTS[variant])
    result = stage(case.hidden, case.layout, case.relevance)
    assert int(result.layout.vision_counts().sum()) == promised_vision_count(
        case.layout, ratio, wps
    )
    # non-vision tokens all survive; the sequence is as long as the longest row
    assert torch.equal(
        (result.layout.kind != TokenKind.VISION).sum(1) - (result.kept_index < 0).sum(1),
        (case.layout.kind != TokenKind.VISION).sum(1),
    )
    assert result.hidden.shape[1] == int((result.kept_index >= 0).sum(1).max())


@pytest.mark.parametrize("variant", sorted(MERGING))
@settings(max_examples=30)
@given(case=batches(), ratio=ratios, wps=st.integers(1, 4))
def test_provenance_partitions_vision_tokens_within_windows(variant, case, ratio, wps):
    stage = Stage(StageSpec(0, ratio, windows_per_side=wps), **MERGING[variant])
    result = stage(case.hidden, case.layout, case.relevance)
    owner = result.provenance.owner
    lay = case.layout
    # every original token is represented by exactly one current token (owner is a function)
    assert (owner >= 0).all()
    # each current token's sources: itself included, same kind, same image, same window, same row
    windows = stage.partitioner.partition(StageInputs.of(lay, windows_per_side=wps)).window
    for b in range(lay.batch_size):
        for j in range(result.kept_index.shape[1]):
            src = result.provenance.sources(b, j)
            orig = int(result.kept_index[b, j])
            if orig < 0:
                assert src == []
                continue
            assert orig in src
            if lay.kind[b, orig] != TokenKind.VISION:
                assert src == [orig]
            else:
                assert len({int(lay.image[b, s]) for s in src}) == 1
                assert len({int(windows[b, s]) for s in src}) == 1
                assert all(lay.kind[b, s] == TokenKind.VISION for s in src)
    # sizes add up to the original length of each row
    assert torch.equal(result.sizes.sum(1), torch.full((lay.batch_size,), lay.seq_len))


@pytest.mark.parametrize(
    "variant", ["lightkv", "relevance-split", "relevance-budget", "relevance-size-mean"]
)
@settings(max_examples=40)  # x 4 variants; each example checks every merged token of a batch
@given(case=batches(), ratio=ratios, wps=st.integers(1, 4))
def test_merged_features_are_relevance_weighted_convex_combinations(variant, case, ratio, wps):
    # (at the first stage every size is 1: relevance_size_mean is the ξ-weighted mean too)
    stage = Stage(StageSpec(0, ratio, windows_per_side=wps), **MERGING[variant])
    result = stage(case.hidden, case.layout, case.relevance)
    for b in range(case.layout.batch_size):
        for j in range(result.kept_index.shape[1]):
            src = result.provenance.sources(b, j)
            if not src:
                continue
            w = case.relevance[b, src]
            expected = (w[:, None] * case.hidden[b, src]).sum(0) / w.sum()
            torch.testing.assert_close(result.hidden[b, j], expected, rtol=0, atol=1e-12)


@given(case=batches(), ratio=ratios, wps=st.integers(1, 4))
def test_text_structural_and_padding_are_untouched(case, ratio, wps):
    result = Stage(StageSpec(0, ratio, windows_per_side=wps))(
        case.hidden, case.layout, case.relevance
    )
    for b in range(case.layout.batch_size):
        idx, hid = strip(result, b)
        other = case.layout.kind[b, idx] != TokenKind.VISION
        assert torch.equal(hid[other], case.hidden[b, idx[other]])
        assert torch.equal(
            result.layout.kind[b][result.kept_index[b] >= 0], case.layout.kind[b, idx]
        )
        assert torch.equal(result.layout.origin[b][result.kept_index[b] >= 0], idx)
        assert torch.equal(
            result.layout.coords[b][result.kept_index[b] >= 0], case.layout.coords[b, idx]
        )
    # holes are zeros, with kind PAD and no origin
    holes = result.kept_index < 0
    assert (result.hidden[holes] == 0).all()
    assert (result.layout.kind[holes] == TokenKind.PAD).all()
    assert (result.layout.origin[holes] == -1).all()


@pytest.mark.parametrize("variant", ["lightkv", "relevance-split", "relevance-budget"])
@given(case=batches(), wps=st.integers(1, 4))
def test_ratio_zero_is_the_identity(variant, case, wps):
    result = Stage(StageSpec(0, 0.0, windows_per_side=wps), **MERGING[variant])(
        case.hidden, case.layout, case.relevance
    )
    assert result.hidden is case.hidden or torch.equal(result.hidden, case.hidden)
    assert result.layout == case.layout
    assert torch.equal(
        result.kept_index, torch.arange(case.layout.seq_len).expand_as(result.kept_index)
    )


@pytest.mark.parametrize("variant", ["lightkv", "relevance-split", "relevance-budget"])
@given(case=batches(max_side=4), wps=st.integers(1, 3))
def test_a_stage_that_removes_nothing_is_bit_exact(variant, case, wps):
    # ratio small enough that floor(ratio * n_w) == 0 for every window: the full path runs
    # (graph, scores, pruning, assembly) but must hand back the input unchanged
    result = Stage(StageSpec(0, 0.05, windows_per_side=wps), **MERGING[variant])(
        case.hidden, case.layout, case.relevance
    )
    assert torch.equal(result.hidden, case.hidden)
    assert result.layout == case.layout


@pytest.mark.parametrize("variant", sorted(MERGING) + ["fastv", "random"])
@settings(max_examples=30)
@given(case=batches(), ratio=ratios, wps=st.integers(1, 4))
def test_rows_do_not_depend_on_the_rest_of_the_batch(variant, case, ratio, wps):
    if variant == "fastv":
        kw = dict(
            partitioner=GlobalPartitioner(scope="row", split="all_src"),
            scorer=None,
            pruner=LowestRelevance(),
            passer=DropMessages(),
        )
    elif variant == "random":
        kw = dict(
            partitioner=GlobalPartitioner(scope="image", split="all_src"),
            scorer=None,
            pruner=RandomPruner(seed=1),
            passer=DropMessages(),
        )
    else:
        kw = MERGING[variant]
    stage = Stage(StageSpec(0, ratio, windows_per_side=wps), **kw)
    batch = stage(case.hidden, case.layout, case.relevance)
    for b in range(case.layout.batch_size):
        alone = stage(case.hidden[b : b + 1], case.layout.row(b), case.relevance[b : b + 1])
        idx_a, hid_a = strip(alone, 0)
        idx_b, hid_b = strip(batch, b)
        assert torch.equal(idx_a, idx_b)
        torch.testing.assert_close(hid_a, hid_b, rtol=0, atol=1e-12)


@given(case=batches(), ratio=st.sampled_from([0.25, 0.5, 0.75]))
def test_pruning_presets_drop_exactly_the_budget_and_do_not_merge(case, ratio):
    stage = Stage(
        StageSpec(0, ratio, windows_per_side=1),
        partitioner=GlobalPartitioner(scope="row", split="all_src"),
        scorer=None,
        pruner=LowestRelevance(),
        passer=DropMessages(),
    )
    result = stage(case.hidden, case.layout, case.relevance)
    n_vis = case.layout.vision_counts()
    assert torch.equal(
        result.layout.vision_counts(), n_vis - torch.floor(n_vis.double() * ratio).long()
    )
    for b in range(case.layout.batch_size):
        idx, hid = strip(result, b)
        assert torch.equal(hid, case.hidden[b, idx])  # survivors unchanged
        # the survivors are the most relevant vision tokens of the row
        vis = case.layout.vision_mask[b]
        kept_vis = vis[idx]
        if kept_vis.any() and (vis.sum() > kept_vis.sum()):
            dropped = torch.ones_like(vis)
            dropped[idx] = False
            dropped &= vis
            assert case.relevance[b, idx[kept_vis]].min() >= case.relevance[b, dropped].max()


def test_lightkv_preset_runs_three_stages_with_growing_windows():
    from lightkv import ImageSegment, VisionLayout

    layout = VisionLayout.from_segments(1, 590, [ImageSegment(0, 5, (24, 24))])
    results = lightkv.load("lightkv").run(torch.randn(1, 590, 16), layout, num_layers=32)
    assert [int(r.layout.vision_counts()) for r in results] == [288, 144, 72]
    sizes = results[-1].sizes[0][results[-1].layout.vision_mask[0]]
    assert int(sizes.sum()) == 576


def test_cosine_scorer_on_keys_uses_the_keys():
    from lightkv import ImageSegment, VisionLayout

    layout = VisionLayout.from_segments(1, 20, [ImageSegment(0, 2, (4, 4))])
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 20, 4, generator=gen, dtype=torch.float64)
    keys = torch.randn(1, 20, 3, generator=gen, dtype=torch.float64)
    on_keys = Stage(
        StageSpec(0, 0.5, windows_per_side=1), scorer=CosineDivergence(features="key_states")
    )
    with_hidden_as_keys = on_keys(hidden, layout, key_states=hidden)
    plain = Stage(StageSpec(0, 0.5, windows_per_side=1))(hidden, layout)
    # (with ratio 0.5 and one window all of A leaves; the partners chosen tell the scorers apart)
    assert torch.equal(with_hidden_as_keys.remap, plain.remap)
    assert not torch.equal(on_keys(hidden, layout, key_states=keys).remap, plain.remap)
