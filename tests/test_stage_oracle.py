"""The fast, batched stage against the slow loop/networkx oracle in tests/oracle.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lightkv
from lightkv import Stage
from lightkv.policies import PseudoSquarePartitioner, StageSpec
from tests.oracle import oracle_stage
from tests.strategies import batches


def _strip(result, b):
    keep = result.kept_index[b] >= 0
    return result.kept_index[b][keep].tolist(), result.hidden[b][keep]


def _check_against_oracle(case, stage, ratio, wps, pseudo):
    result = stage(case.hidden, case.layout, case.relevance)
    expected = oracle_stage(
        case.hidden, case.layout, case.relevance, ratio, wps, pseudo_square=pseudo
    )
    for b, (kept, feats, absorbed) in enumerate(expected):
        got_kept, got_hidden = _strip(result, b)
        assert got_kept == kept
        torch.testing.assert_close(
            got_hidden, torch.tensor(feats, dtype=torch.float64), rtol=0, atol=1e-12
        )
        # provenance: new token j (at input position kept[j]) absorbed exactly these tokens
        offset = result.kept_index.shape[1] - len(kept)
        for j, pos in enumerate(kept):
            assert result.provenance.sources(b, offset + j) == absorbed[pos]


@given(case=batches(), ratio=st.sampled_from([0.25, 0.5, 0.9]), wps=st.integers(1, 4))
def test_grid_stage_matches_oracle(case, ratio, wps):
    stage = Stage(StageSpec(layer=0, removal_ratio=ratio, windows_per_side=wps))
    _check_against_oracle(case, stage, ratio, wps, pseudo=False)


@given(case=batches(newlines=False), ratio=st.sampled_from([0.3, 0.5]), wps=st.integers(1, 3))
def test_pseudo_square_stage_matches_oracle(case, ratio, wps):
    stage = Stage(
        StageSpec(layer=0, removal_ratio=ratio, windows_per_side=wps),
        partitioner=PseudoSquarePartitioner(),
    )
    _check_against_oracle(case, stage, ratio, wps, pseudo=True)


def test_two_stages_match_oracle_applied_twice():
    from lightkv import ImageSegment, VisionLayout
    from tests.strategies import Case  # noqa: F401  (documented type)

    layout = VisionLayout.from_segments(
        2, 40, [ImageSegment(0, 2, (5, 6)), ImageSegment(1, 1, (4, 4)), ImageSegment(1, 18, (3, 5))]
    )
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 40, 5, generator=gen, dtype=torch.float64)
    xi = torch.rand(2, 40, generator=gen, dtype=torch.float64)
    first = Stage(StageSpec(layer=0, removal_ratio=0.5, windows_per_side=2))(hidden, layout, xi)
    xi2 = xi.gather(1, first.kept_index.clamp_min(0))
    second = Stage(StageSpec(layer=1, removal_ratio=0.5, windows_per_side=1))(
        first.hidden, first.layout, xi2, first.provenance
    )
    once = oracle_stage(hidden, layout, xi, 0.5, 2)
    twice = oracle_stage(first.hidden, first.layout, xi2, 0.5, 1)
    for b in range(2):
        kept2, feats2, absorbed2 = twice[b]
        got_kept, got_hidden = _strip(second, b)
        # second-stage kept positions index the first stage's output
        assert got_kept == kept2
        torch.testing.assert_close(
            got_hidden, torch.tensor(feats2, dtype=torch.float64), rtol=0, atol=1e-12
        )
        # composed provenance: original tokens behind each final token
        offset = second.kept_index.shape[1] - len(kept2)
        first_kept, _, absorbed1 = once[b]
        first_offset = first.kept_index.shape[1] - len(first_kept)
        for j, pos in enumerate(kept2):
            originals = sorted(
                o
                for p in absorbed2[pos]
                if p >= first_offset
                for o in absorbed1[first_kept[p - first_offset]]
            )
            assert second.provenance.sources(b, offset + j) == originals


@pytest.mark.parametrize(
    "grid,schedule,expected",
    [
        ((24, 24), ((12, 18, 24), (4, 2, 1)), [288, 145, 73]),  # LLaVA-1.5
        ((32, 32), ((12, 17, 22), (6, 4, 2)), [520, 260, 131]),  # Qwen2.5-VL
        ((48, 61), ((12, 18, 24), (4, 2, 1)), [1465, 733, 367]),  # 2928 tokens (LLaVA-NeXT)
    ],
)
def test_paper_preset_reproduces_reference_token_counts(grid, schedule, expected):
    from lightkv import ImageSegment, VisionLayout
    from lightkv.policies import ExplicitSchedule

    n = grid[0] * grid[1] + 10
    layout = VisionLayout.from_segments(1, n, [ImageSegment(0, 4, grid)])
    pipe = lightkv.load("lightkv-paper")
    pipe.scheduler = ExplicitSchedule(
        layers=schedule[0], windows_per_side=schedule[1], removal_ratios=(0.5,)
    )
    results = pipe.run(torch.randn(1, n, 8), layout, num_layers=32)
    assert [int(r.layout.vision_counts()) for r in results] == expected
