"""`RelevanceCoverage` against a slow reference written from its definition, DivPrune as
its special case; every keep-set pruner composed with every merging passer (each dropped
token merges into its most similar survivor)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv import ImageSegment, VisionLayout
from lightkv.graph.provenance import Provenance
from lightkv.methods import DivPrune, RelevanceCoverage
from lightkv.policies import (
    CosineDivergence,
    GlobalPartitioner,
    KeepSetPruner,
    MessagePasser,
    Prompt,
    Pruner,
    StageInputs,
    StageSpec,
)
from lightkv.stage import Stage
from lightkv.testing.contract import check_policy
from tests.policies.keep_set_cases import (
    assert_rows_independent,
    kept_positions,
    one_image,
    prune_inputs,
    slow_cos,
)
from tests.strategies import batches


def _cos_dist(a, b) -> float:
    return 1.0 - slow_cos(a, b)


def slow_coverage(tokens, xi, coords, diag, keep, share, power, spatial) -> set[int]:
    """The definition, one token at a time: ceil(share * keep) tokens of highest xi (ties:
    earliest), then argmax of gap * (xi / max xi)^power (ties: earliest), gap the distance
    to the nearest kept token (nearest other token while none is kept)."""
    n = len(tokens)

    def d(i, j):
        sp = math.dist(coords[i], coords[j]) / diag
        return _cos_dist(tokens[i], tokens[j]) + spatial * min(sp, 1.0)

    n_rel = min(keep, math.ceil(keep * share - 1e-9)) if min(xi) < max(xi) else 0
    by_rel = sorted(range(n), key=lambda i: (-xi[i], i))
    kept = by_rel[:n_rel]
    top = max(xi)
    q = [x / top if top > 0 else 1.0 for x in xi]
    while len(kept) < keep:
        best, best_j = -math.inf, None
        for j in range(n):
            if j in kept:
                continue
            ref = kept if kept else [i for i in range(n) if i != j]
            gap = min((d(i, j) for i in ref), default=math.inf)
            s = gap if power == 0 else min(gap, 2.0) * q[j] ** power
            if s > best:
                best, best_j = s, j
        kept.append(best_j)
    return set(kept)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(2, 14),
    keep=st.integers(1, 14),
    share=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    power=st.sampled_from([0.0, 1.0, 2.0]),
    spatial=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_kept_set_equals_the_slow_reference(n, keep, share, power, spatial, seed):
    keep = min(keep, n)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n + 3, 4, generator=gen, dtype=torch.float64)
    xi = torch.rand(n + 3, generator=gen, dtype=torch.float64)
    stage = one_image(hidden, relevance=xi.unsqueeze(0))
    prune = prune_inputs(stage)
    prune = type(prune)(
        prune.graph,
        prune.divergence,
        prune.graph.blocks(prune.graph.gather(stage.relevance), "src"),
        prune.identity,
        stage,
    )
    got = RelevanceCoverage(share=share, power=power, spatial=spatial).select(prune, 1 - keep / n)
    kept = {p - 1 for p in kept_positions(prune, got)[0]}
    coords = [(0, c) for c in range(n)]  # a 1 x n grid
    want = slow_coverage(
        hidden[1 : n + 1].tolist(),
        xi[1 : n + 1].tolist(),
        coords,
        math.hypot(1, n),
        keep,
        share,
        power,
        spatial,
    )
    assert kept == want


@settings(max_examples=25, deadline=None)
@given(case=batches(max_side=6), ratio=st.floats(0.05, 0.95))
def test_share_zero_power_zero_is_divprune(case, ratio):
    stage = StageInputs.of(case.layout, case.hidden, windows_per_side=1, relevance=case.relevance)
    prune = prune_inputs(stage)
    assert torch.equal(
        RelevanceCoverage(share=0.0, power=0.0).select(prune, ratio),
        DivPrune().select(prune, ratio),
    )


def test_share_one_keeps_the_most_relevant():
    hidden = torch.randn(10, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    xi = torch.tensor([0.0, 0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.05, 0.0, 0.0], dtype=torch.float64)
    stage = one_image(hidden, relevance=xi.unsqueeze(0))
    prune = prune_inputs(stage)
    prune = type(prune)(
        prune.graph,
        prune.divergence,
        prune.graph.blocks(prune.graph.gather(xi.unsqueeze(0)), "src"),
        prune.identity,
        stage,
    )
    removed = RelevanceCoverage(share=1.0).select(prune, 1 - 3 / 7)
    assert kept_positions(prune, removed) == [[2, 4, 6]]


def test_uniform_relevance_is_coverage_alone():
    hidden = torch.randn(12, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    stage = one_image(hidden, relevance=torch.full((1, 12), 0.3, dtype=torch.float64))
    prune = prune_inputs(stage)
    assert torch.equal(
        RelevanceCoverage(share=0.75, spatial=0.5).select(prune, 0.5),
        RelevanceCoverage(share=0.0, spatial=0.5).select(prune, 0.5),
    )


def test_spatial_keeps_two_identical_tokens_far_apart():
    # tokens 0 and 5 are the same direction (two gems of one colour), far apart; the rest
    # are near-duplicates of another direction (ground). Cosine alone keeps one gem.
    ground = torch.tensor([0.0, 1.0])
    rows = (
        [torch.tensor([1.0, 0.0])]
        + [ground + 0.01 * i for i in range(1, 5)]
        + [torch.tensor([1.0, 0.0])]
    )
    hidden = torch.cat([torch.ones(1, 2), torch.stack(rows), torch.ones(2, 2)]).double()
    prune = prune_inputs(one_image(hidden))
    cosine = {
        p - 1 for p in kept_positions(prune, RelevanceCoverage(share=0.0).select(prune, 0.5))[0]
    }
    spatial = {
        p - 1
        for p in kept_positions(
            prune, RelevanceCoverage(share=0.0, spatial=1.0).select(prune, 0.5)
        )[0]
    }
    assert not {0, 5} <= cosine and {0, 5} <= spatial


@pytest.mark.parametrize(
    "bad",
    [
        {"share": -0.1},
        {"share": 1.5},
        {"power": -1},
        {"power": math.inf},
        {"spatial": math.nan},
        {"share": True},
    ],
)
def test_bad_parameters_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        RelevanceCoverage(**bad)


def test_contract_and_rows_independent():
    check_policy(RelevanceCoverage, share=0.5, power=1.0, spatial=0.5)
    gen = torch.Generator().manual_seed(3)
    segs = [ImageSegment(0, 1, (3, 4)), ImageSegment(1, 2, (2, 3))]
    pad = torch.zeros(2, 17, dtype=torch.bool)
    pad[1, :1] = True
    layout = VisionLayout.from_segments(2, 17, segs, padding_mask=pad)
    hidden = torch.randn(2, 17, 5, generator=gen, dtype=torch.float64)
    xi = torch.rand(2, 17, generator=gen, dtype=torch.float64)
    inputs = StageInputs.of(layout, hidden, windows_per_side=1, relevance=xi)
    assert_rows_independent(RelevanceCoverage(share=0.5, power=1.0, spatial=0.5), inputs, 0.6)


# ---------------------------------------------------------------- keep sets x merging passers
KEEP_SETS = sorted(
    name for name, cls in Pruner.registered().items() if issubclass(cls, KeepSetPruner)
)
MERGING = sorted(name for name, cls in MessagePasser.registered().items() if cls.merges)


@pytest.mark.parametrize("passer", MERGING)
@pytest.mark.parametrize("pruner", KEEP_SETS)
def test_every_keep_set_merges_each_dropped_token_into_its_most_similar_survivor(pruner, passer):
    assert len(KEEP_SETS) >= 4 and len(MERGING) >= 3
    gen = torch.Generator().manual_seed(7)
    n_text = 3
    layout = VisionLayout.from_segments(1, 1 + 16 + n_text, [ImageSegment(0, 1, (4, 4))])
    hidden = torch.randn(1, 20, 6, generator=gen, dtype=torch.float64)
    xi = torch.rand(1, 20, generator=gen, dtype=torch.float64) + 0.1
    prompt = Prompt(torch.arange(20).unsqueeze(0))
    stage = Stage(
        spec=StageSpec(0, 0.75, windows_per_side=1),
        partitioner=GlobalPartitioner(split="all_src"),
        scorer=CosineDivergence(),
        pruner=Pruner.create(pruner),
        passer=MessagePasser.create(passer),
    )
    try:
        res = stage(hidden, layout, xi, key_states=hidden.view(1, 20, 2, 3), prompt=prompt)
    except ValueError as err:  # a pruner that needs a model's context (e.g. the tower) says so
        pytest.skip(f"{pruner}: {err}")
    kept = set(res.kept_index[0][res.kept_index[0] >= 0].tolist())
    vision = set(range(1, 17))
    survivors = sorted(vision & kept)
    assert len(survivors) == 16 - 12
    x = hidden[0]
    weights = MessagePasser.create(passer).weight(xi[0], torch.ones(20, dtype=torch.long)).double()
    groups: dict[int, list[int]] = {s: [s] for s in survivors}
    for t in sorted(vision - kept):
        # oracle: the survivor of largest cosine (ties: the earliest)
        sims = [float(torch.dot(x[t], x[s]) / (x[t].norm() * x[s].norm())) for s in survivors]
        best = survivors[max(range(len(sims)), key=lambda i: (sims[i], -i))]
        assert int(res.remap[0, t]) == int(res.remap[0, best])
        groups[best].append(t)
    for s, members in groups.items():
        w = weights[members]
        want = (w.unsqueeze(1) * x[members]).sum(0) / w.sum() if w.sum() > 0 else x[members].mean(0)
        if passer == "target_plus_mean":  # VisionZip: the survivor plus the mean merged into it
            want = x[s] + (x[members[1:]].mean(0) if members[1:] else 0)
        if passer == "weighted_sum":  # PruMerge+'s extra token: the weighted sum, undivided
            want = (w.unsqueeze(1) * x[members]).sum(0)
        torch.testing.assert_close(
            res.hidden[0, int(res.remap[0, s])], want, rtol=1e-12, atol=1e-12
        )
    counts = Provenance(res.provenance.owner, res.provenance.current_len).sizes()
    assert int(counts[0][res.kept_index[0] >= 0].sum()) == 20
    if res.provenance.weight is None:  # sizes count tokens (saliency_sizes weighs them: era)
        assert torch.equal(res.sizes, counts)


# ---------------------------------------------------------------- windows: exact per image
@settings(max_examples=40, deadline=None)
@given(case=batches(max_side=8), ratio=st.floats(0.05, 0.95), windows=st.integers(1, 3))
def test_windows_keep_exactly_the_image_budget(case, ratio, windows):
    """With grid windows, every image keeps ``n - floor(ratio * n)`` of its ``n`` tokens, as
    with one window per image, and each window loses the floor or the ceiling of its own
    share (largest remainder): counted from the stage's output, not from the policy."""
    from lightkv.policies import DropMessages, GridPartitioner
    from lightkv.policies.counts import removal_count

    inputs = StageInputs.of(
        case.layout, case.hidden, windows_per_side=windows, relevance=case.relevance
    )
    part = GridPartitioner(split="all_src").partition(inputs)
    stage = Stage(
        spec=StageSpec(0, ratio, windows_per_side=windows),
        partitioner=GridPartitioner(split="all_src"),
        scorer=None,
        pruner=RelevanceCoverage(spatial=0.25),
        passer=DropMessages(),
    )
    out = stage.run(inputs)
    kept = torch.zeros_like(case.layout.vision_mask)
    for b in range(case.layout.batch_size):
        origin = out.layout.origin[b][out.layout.valid_mask[b]]
        kept[b, origin] = True
    vision = case.layout.vision_mask
    for img in range(case.layout.image_grid.shape[0]):
        member = vision & (case.layout.image == img)
        n = int(member.sum())
        if n == 0:
            continue
        assert int((kept & member).sum()) == n - int(removal_count(torch.tensor(n), ratio))
        for w in part.window[member].unique().tolist():
            in_w = member & (part.window == w)
            lost, ideal = int((in_w & ~kept).sum()), ratio * int(in_w.sum())
            assert math.floor(ideal + 1e-9) <= lost <= math.ceil(ideal - 1e-9)


@settings(max_examples=40, deadline=None)
@given(
    case=batches(max_side=9, max_images=3),
    ratio=st.floats(0.1, 0.9),
    spatial=st.sampled_from([0.0, 0.5]),
)
def test_windows_in_size_groups_pick_as_one_block(case, ratio, spatial):
    """Windows of different sizes run in groups padded to their own largest window; the
    picks equal those of one block padded to the largest window of all."""
    from lightkv.policies import PruneInputs

    inputs = StageInputs.of(case.layout, case.hidden, windows_per_side=1, relevance=case.relevance)
    prune = prune_inputs(inputs)
    graph = prune.graph
    prune = PruneInputs(
        graph, prune.divergence, graph.token_blocks(case.relevance, "src"), prune.identity, inputs
    )
    valid = graph.src_slots >= 0
    count = valid.sum(1) - torch.floor(valid.sum(1).double() * ratio).long()
    pruner = RelevanceCoverage(share=0.25, spatial=spatial)
    assert torch.equal(pruner.keep(prune, count), pruner._keep(prune, count))


def test_size_groups_split_a_base_view_from_its_tiles():
    """LLaVA-NeXT's shape in small: a 2 x 2 base image beside an 8 x 8 tile grid."""
    layout = VisionLayout.from_segments(
        1, 70, [ImageSegment(0, 1, (2, 2)), ImageSegment(0, 5, (8, 8))]
    )
    inputs = StageInputs.of(layout, torch.randn(1, 70, 4, dtype=torch.float64), windows_per_side=1)
    graph = prune_inputs(inputs).graph
    assert [g.tolist() for g in graph.window_groups(pairs="aa")] == [[1], [0]]
    assert len(graph.window_groups(pairs="ab")) == 1  # all sources: no A x B pairs to pad
