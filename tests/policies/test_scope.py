"""SCOPE against a slow greedy written from the paper's definitions (set-coverage, token-coverage
gain, SCOPE score = gain x saliency^alpha)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv.methods import SCOPE
from lightkv.policies import StageInputs
from tests.policies.keep_set_cases import (
    assert_rows_independent,
    kept_positions,
    one_image,
    prune_inputs,
    slow_cos,
)
from tests.strategies import batches


def slow_scope(
    tokens: list[list[float]], saliency: list[float], keep: int, alpha: float = 1.0
) -> list[int]:
    """Each step adds the token of largest ``(C(S + j) - C(S)) * a_j^alpha`` with
    ``C(S) = sum_i max(0, max_{s in S} cos(i, s))``; ties: the earliest."""
    n = len(tokens)
    sim = [[1.0 if i == j else slow_cos(tokens[i], tokens[j]) for j in range(n)] for i in range(n)]

    def coverage(picks: list[int]) -> list[float]:
        return [max([0.0] + [sim[i][s] for s in picks]) for i in range(n)]

    picks: list[int] = []
    for _ in range(keep):
        cover = coverage(picks)
        best, best_j = -math.inf, -1
        for j in range(n):
            if j in picks:
                continue
            gain = sum(max(0.0, sim[i][j] - cover[i]) for i in range(n))
            score = gain * saliency[j] ** alpha
            if score > best:
                best, best_j = score, j
        picks.append(best_j)
    return picks


def _with_relevance(stage: StageInputs, relevance: torch.Tensor):
    prune = prune_inputs(replace(stage, relevance=relevance))
    return replace(prune, relevance=prune.graph.token_blocks(relevance, "src"))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 14),
    dim=st.integers(2, 6),
    seed=st.integers(0, 2**31 - 1),
    alpha=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    data=st.data(),
)
def test_equals_the_slow_greedy(n, dim, seed, alpha, data):
    keep = data.draw(st.integers(0, n))
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n + 3, dim, generator=gen, dtype=torch.float64)
    relevance = torch.rand(1, n + 3, generator=gen, dtype=torch.float64)
    prune = _with_relevance(one_image(hidden), relevance)
    removed = SCOPE(alpha=alpha).select(prune, 1 - keep / n)
    picks = slow_scope(hidden[1 : 1 + n].tolist(), relevance[0, 1 : 1 + n].tolist(), keep, alpha)
    assert kept_positions(prune, removed) == [sorted(1 + p for p in picks)]


def test_saliency_decides_between_equal_coverage_and_coverage_between_equal_saliency():
    # tokens 0/1 share a direction, 2 is orthogonal: keeping two, coverage wants {one of 0/1, 2}
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    hidden = torch.cat([torch.ones(1, 2), x, torch.ones(2, 2)]).double()
    flat = torch.ones(1, 6, dtype=torch.float64)
    prune = _with_relevance(one_image(hidden), flat)
    assert kept_positions(prune, SCOPE().select(prune, 1 - 2 / 3)) == [
        [1, 3]
    ]  # tie 0/1: the earliest
    salient = flat.clone()
    salient[0, 2] = 3.0  # token 1 more salient than its duplicate 0
    prune = _with_relevance(one_image(hidden), salient)
    assert kept_positions(prune, SCOPE().select(prune, 1 - 2 / 3)) == [[2, 3]]
    assert kept_positions(prune, SCOPE().select(prune, 1 - 1 / 3)) == [
        [2]
    ]  # gain 2 x 3 beats 2 x 1 and 1 x 1


@settings(max_examples=25, deadline=None)
@given(case=batches(max_side=6), ratio=st.sampled_from([0.0, 0.3, 0.7777777777777778]))
def test_rows_are_independent_with_relevance(case, ratio):
    inputs = StageInputs.of(
        case.layout, case.hidden, windows_per_side=1, removal_ratio=ratio, relevance=case.relevance
    )
    assert_rows_independent(SCOPE(), inputs, ratio)


def test_alpha_is_checked():
    with pytest.raises(ValueError, match="alpha"):
        SCOPE(alpha=-1.0)
