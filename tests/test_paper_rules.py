"""The reference code's arithmetic, rule by rule, with the numbers of issue 13.

Expected values are worked out by hand (in the comments) or come from the loop oracle in
`tests/oracle.py`, never from the fast path's own formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lightkv
from lightkv import ImageSegment, Stage, StageInputs, VisionLayout
from lightkv.graph import grid_windows, pseudo_square_windows
from lightkv.policies import (
    ExplicitSchedule,
    GridPartitioner,
    LastTokenAttention,
    PseudoSquarePartitioner,
    QueryAxisSoftmax,
    SmallestDivergence,
    StageSpec,
)
from tests.oracle import band_lengths, oracle_stage
from tests.strategies import batches


def _bands_along_rows(window: torch.Tensor, h: int, w: int) -> list[int]:
    """Lengths of the runs of equal window ids down the first column of an h x w image."""
    col = window[0, : h * w].view(h, w)[:, 0].tolist()
    runs, last = [], None
    for v in col:
        if v == last:
            runs[-1] += 1
        else:
            runs.append(1)
            last = v
    return runs


@pytest.mark.parametrize(
    "rule,expected", [("leading", [6, 6, 5, 5, 5, 5]), ("proportional", [6, 5, 5, 6, 5, 5])]
)
def test_window_bands_of_a_32_token_side_into_6(rule, expected):
    layout = VisionLayout.from_segments(1, 32 * 32, [ImageSegment(0, 0, (32, 32))])
    assert _bands_along_rows(grid_windows(layout, 6, bands=rule), 32, 32) == expected
    # the pseudo-square of 1024 tokens is the 32 x 32 grid itself
    assert _bands_along_rows(pseudo_square_windows(layout, 6, bands=rule), 32, 32) == expected
    assert band_lengths(32, 6, rule) == expected


def test_the_two_band_rules_differ_in_survivors_on_qwens_grid():
    layout = VisionLayout.from_segments(1, 1024, [ImageSegment(0, 0, (32, 32))])
    x = torch.randn(1, 1024, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    kept = {}
    for rule in ("leading", "proportional"):
        res = Stage(StageSpec(0, 0.5, windows_per_side=6), partitioner=GridPartitioner(bands=rule))(
            x, layout
        )
        kept[rule] = set(res.kept_index[0].tolist())
        assert len(kept[rule]) == 520  # counts agree ...
    assert kept["leading"] != kept["proportional"]  # ... windows do not


@pytest.mark.parametrize("rule", ["leading", "proportional"])
@given(case=batches(), ratio=st.sampled_from([0.5, 0.75]), wps=st.integers(1, 4))
def test_grid_bands_match_the_oracle(rule, case, ratio, wps):
    stage = Stage(
        StageSpec(0, ratio, windows_per_side=wps), partitioner=GridPartitioner(bands=rule)
    )
    _compare(stage, case, ratio, wps, bands=rule)


@given(
    case=batches(newlines=False),
    ratio=st.sampled_from([0.5, 0.75, 0.9]),
    wps=st.integers(1, 3),
    cap=st.sampled_from(["sources", "half"]),
    min_tokens=st.sampled_from([0, 1, 2]),
)
def test_paper_rules_match_the_oracle(case, ratio, wps, cap, min_tokens):
    stage = Stage(
        StageSpec(0, ratio, windows_per_side=wps),
        partitioner=PseudoSquarePartitioner(min_tokens_per_window=min_tokens),
        pruner=SmallestDivergence(cap=cap),
    )
    _compare(stage, case, ratio, wps, pseudo_square=True, cap=cap, min_tokens=min_tokens)


def _compare(stage, case, ratio, wps, **rules):
    res = stage(case.hidden, case.layout, case.relevance)
    expected = oracle_stage(case.hidden, case.layout, case.relevance, ratio, wps, **rules)
    for b, (kept, feats, _) in enumerate(expected):
        keep = res.kept_index[b] >= 0
        assert res.kept_index[b][keep].tolist() == kept
        torch.testing.assert_close(
            res.hidden[b][keep], torch.tensor(feats, dtype=torch.float64), rtol=0, atol=1e-12
        )


@pytest.mark.parametrize("cap,left", [("sources", 143), ("half", 145)])
def test_budget_cap_above_one_half(cap, left):
    # 288 tokens -> a 17 x 17 pseudo-square, 2 bands of 9 and 8 per side: windows of 81, 72,
    # 72 and 63 tokens. At P = 0.75, floor(P * n) exceeds both caps everywhere; |A| = ceil(n/2)
    # removes 41 + 36 + 36 + 32 = 145 (143 left), floor(n/2) removes 40 + 36 + 36 + 31 = 143
    # (145 left, the reference code).
    layout = VisionLayout.from_segments(1, 300, [ImageSegment(0, 2, (16, 18))])
    stage = Stage(
        StageSpec(0, 0.75, windows_per_side=2),
        partitioner=PseudoSquarePartitioner(),
        pruner=SmallestDivergence(cap=cap),
    )
    assert (
        int(stage(torch.randn(1, 300, 4, dtype=torch.float64), layout).layout.vision_counts())
        == left
    )


@pytest.mark.parametrize(
    "grid,ratio,exact,float32",
    # 180 * 0.35 = 62.99999999999999 in float64 (62 leave), 63.0 once rounded to float32 (63
    # leave); 100 * 0.29 = 28.999999999999996 (28) against 29.0 (29): the released code's
    # (P * counts).long() keeps 117 and 71 where the exact floor keeps 118 and 72
    [((12, 15), 0.35, 118, 117), ((10, 10), 0.29, 72, 71), ((24, 24), 0.5, 288, 288)],
)
def test_float32_budget_product(grid, ratio, exact, float32):
    n = grid[0] * grid[1]
    layout = VisionLayout.from_segments(1, n + 6, [ImageSegment(0, 3, grid)])
    x = torch.randn(1, n + 6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    kept = {}
    for dtype in ("float64", "float32"):
        stage = Stage(
            StageSpec(0, ratio, windows_per_side=1),
            partitioner=PseudoSquarePartitioner(),
            pruner=SmallestDivergence(cap="half", budget_dtype=dtype),
        )
        kept[dtype] = int(stage(x, layout).layout.vision_counts())
    assert (kept["float64"], kept["float32"]) == (exact, float32)
    with pytest.raises(ValueError, match="unknown budget_dtype 'float16'.*'float64'.*'float32'"):
        SmallestDivergence(budget_dtype="float16").budget(_graph(layout), ratio)


def _graph(layout):
    from lightkv.graph import BipartiteGraph

    part = PseudoSquarePartitioner().partition(StageInputs.of(layout, windows_per_side=1))
    return BipartiteGraph.build(part.window, part.is_src)


def _counts(preset, grid, layers=28, schedule=None):
    n = grid[0] * grid[1] + 10
    layout = VisionLayout.from_segments(1, n, [ImageSegment(0, 4, grid)])
    pipe = lightkv.load(preset)
    if schedule is not None:
        pipe.scheduler = schedule
    return [
        int(r.layout.vision_counts())
        for r in pipe.run(torch.randn(1, n, 8), layout, num_layers=layers)
    ]


def test_skip_rule_on_qwens_smallest_image():
    # 256 < 8 * 6**2 = 288: stage 1 leaves it; 256 >= 8 * 4**2: 16 windows of 16 -> 128; then
    # 128 tokens in a 12 x 12 pseudo-square, 2 x 2 windows of 36, 36, 30, 26 -> 64.
    assert _counts("lightkv-paper-qwen2_5_vl", (16, 16)) == [256, 128, 64]


def test_skip_rule_is_per_row_and_off_by_default():
    layout = VisionLayout.from_segments(
        2, 80, [ImageSegment(0, 0, (8, 8)), ImageSegment(1, 0, (8, 8)), ImageSegment(1, 70, (3, 3))]
    )
    x = torch.randn(2, 80, 4, dtype=torch.float64)
    spec = StageSpec(0, 0.5, windows_per_side=1)
    skip = Stage(spec, partitioner=PseudoSquarePartitioner(min_tokens_per_window=16))(x, layout)
    # row 1 holds a 9-token image (< 16): the whole row is left alone; row 0 is compressed
    assert (skip.kept_index[1] >= 0).sum() == 80 and (skip.kept_index[0] >= 0).sum() == 48
    plain = Stage(spec, partitioner=PseudoSquarePartitioner())(x, layout)
    assert (plain.kept_index[1] >= 0).sum() < 80


@pytest.mark.parametrize(
    "preset,grid,expected",
    [
        ("lightkv-paper", (24, 24), [288, 145, 73]),
        ("lightkv-paper-qwen2_5_vl", (32, 32), [520, 260, 131]),
        ("lightkv-paper-released", (24, 24), [288, 145, 73]),
        ("lightkv-paper-released-qwen2_5_vl", (32, 32), [520, 260, 131]),
    ],
)
def test_paper_counts_still_hold_with_all_rules(preset, grid, expected):
    assert _counts(preset, grid, layers=32) == expected


@pytest.mark.parametrize("policy", [QueryAxisSoftmax(), LastTokenAttention()])
@pytest.mark.parametrize(
    "dtype,want",
    [
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
)
def test_relevance_precision_is_at_least_float32_and_never_below_the_input(policy, dtype, want):
    layout = VisionLayout.from_segments(1, 12, [ImageSegment(0, 2, (2, 3))])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 12, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, 12, 4, generator=gen, dtype=torch.float64)
    xi = policy.score(q.to(dtype), k.to(dtype), layout)
    assert xi.dtype == want
    if dtype == torch.float64 and isinstance(policy, QueryAxisSoftmax):
        # the definition, in float64: softmax over the query axis of q.k/sqrt(d) against the
        # text keys, summed over heads and text columns; float32 arithmetic misses by ~1e-7
        text = layout.text_mask[0]
        logits = q[0] @ k[0][:, text].transpose(-1, -2) / 2.0
        want_xi = torch.softmax(logits, dim=1).sum(dim=(0, 2)) * layout.vision_mask[0]
        torch.testing.assert_close(xi[0], want_xi, rtol=0, atol=1e-14)


def test_bad_band_rule_and_cap_are_named():
    with pytest.raises(ValueError, match="bands"):
        GridPartitioner(bands="middle")
    layout = VisionLayout.from_segments(1, 12, [ImageSegment(0, 2, (2, 3))])
    stage = Stage(StageSpec(0, 0.5, windows_per_side=1), pruner=SmallestDivergence(cap="third"))
    with pytest.raises(ValueError, match="cap"):
        stage(torch.randn(1, 12, 4), layout)


@pytest.mark.parametrize("preset", ["lightkv-paper", "lightkv-paper-qwen2_5_vl"])
def test_the_paper_presets_round_budgets_as_the_reference_code(preset):
    """Regression (issue 27, item 13): ``lightkv-paper`` kept 118 of a 12x15 image at P = 0.35
    where the reference code's ``(P * counts).long()`` keeps 117."""
    import lightkv

    layout = VisionLayout.from_segments(1, 186, [ImageSegment(0, 3, (12, 15))])
    x = torch.randn(1, 186, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pipe = lightkv.load(preset).with_scheduler(
        ExplicitSchedule(layers=(0,), removal_ratios=(0.35,), windows_per_side=(1,))
    )
    (result,) = pipe.run(x, layout, num_layers=4)
    assert int(result.layout.vision_counts()) == 117
