"""MMTok against a slow greedy written from the paper's maximum-coverage objective: the kept set
covers the question's tokens (text-vision softmax similarities) and the image's tokens
(vision-vision softmax similarities, weighted by alpha)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv.methods import MMTok
from lightkv.policies import Prompt, StageInputs
from tests.policies.keep_set_cases import (
    assert_rows_independent,
    kept_positions,
    one_image,
    prune_inputs,
    slow_cos,
)
from tests.strategies import batches


def _softmax(values: list[float]) -> list[float]:
    top = max(values)
    e = [math.exp(v - top) for v in values]
    return [v / sum(e) for v in e]


def slow_coverage_rows(tokens, question, alpha=0.5, tau_tv=0.02, tau_vv=0.2) -> list[list[float]]:
    """The rows to cover: ``P[m] = softmax_j(cos(t_m, x_j) / tau_tv) / M`` for each question
    token, then ``alpha * softmax_j(cos(x_i, x_j) / tau_vv) / n`` for each image token."""
    n, m = len(tokens), len(question)
    rows = [[p / m for p in _softmax([slow_cos(t, x) / tau_tv for x in tokens])] for t in question]
    for i in range(n):
        sims = [(1.0 if i == j else slow_cos(tokens[i], tokens[j])) / tau_vv for j in range(n)]
        rows.append([alpha * q / n for q in _softmax(sims)])
    return rows


def slow_max_coverage(rows: list[list[float]], keep: int) -> list[int]:
    """Each step adds the token that raises ``f(S) = sum_r max_{j in S} C[r][j]`` (empty max:
    0) the most; ties: the earliest."""
    n = len(rows[0])
    picks: list[int] = []

    def f(s: list[int]) -> float:
        return sum(max([0.0] + [r[j] for j in s]) for r in rows)

    for _ in range(keep):
        base = f(picks)
        best, best_j = -math.inf, -1
        for j in range(n):
            if j in picks:
                continue
            gain = f(picks + [j]) - base
            if gain > best:
                best, best_j = gain, j
        picks.append(best_j)
    return picks


def _case(n: int, dim: int, seed: int, question: int):
    hidden = torch.randn(
        1 + n + question, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    ids = torch.arange(hidden.shape[0]).unsqueeze(0)
    return hidden, one_image(hidden, before=1, after=question, prompt=Prompt(ids))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    dim=st.integers(2, 6),
    question=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    params=st.sampled_from(
        [
            {},
            {"alpha": 2.0, "tau_tv": 0.5, "tau_vv": 1.0},
            {"alpha": 0.0, "tau_tv": 0.3},
            {"alpha": 8.0, "tau_tv": 1.0, "tau_vv": 0.1},
        ]
    ),
    data=st.data(),
)
def test_equals_the_slow_greedy(n, dim, question, seed, params, data):
    keep = data.draw(st.integers(0, n))
    hidden, stage = _case(n, dim, seed, question)
    prune = prune_inputs(stage)
    removed = MMTok(**params).select(prune, 1 - keep / n)
    rows = slow_coverage_rows(hidden[1 : 1 + n].tolist(), hidden[1 + n :].tolist(), **params)
    assert kept_positions(prune, removed) == [sorted(1 + p for p in slow_max_coverage(rows, keep))]


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 10), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_without_a_prompt_it_covers_the_image_alone(n, seed, data):
    keep = data.draw(st.integers(0, n))
    hidden, _ = _case(n, 4, seed, question=2)
    prune = prune_inputs(one_image(hidden, before=1, after=2))  # no prompt: no question rows
    rows = slow_coverage_rows(hidden[1 : 1 + n].tolist(), [])
    want = [sorted(1 + p for p in slow_max_coverage(rows, keep))]
    assert kept_positions(prune, MMTok().select(prune, 1 - keep / n)) == want


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(2, 10), question=st.integers(1, 3), seed=st.integers(0, 2**31 - 1), data=st.data()
)
def test_the_text_rows_are_a_mean_over_the_question_tokens(n, question, seed, data):
    """Saying the question twice changes nothing: ``P`` is divided by the question's length."""
    keep = data.draw(st.integers(1, n))
    hidden, stage = _case(n, 3, seed, question)
    twice = torch.cat([hidden, hidden[1 + n :]])
    stage2 = one_image(
        twice,
        before=1,
        after=2 * question,
        prompt=Prompt(torch.arange(twice.shape[0]).unsqueeze(0)),
    )
    pruner = MMTok(alpha=4.0, tau_tv=0.5, tau_vv=0.5)
    once = kept_positions(prune_inputs(stage), pruner.select(prune_inputs(stage), 1 - keep / n))
    again = kept_positions(prune_inputs(stage2), pruner.select(prune_inputs(stage2), 1 - keep / n))
    assert once == again


def test_the_question_pulls_the_selection_toward_the_token_it_resembles():
    # four image tokens on the unit circle; the question token points at token 2
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.1], [0.0, -1.0]], dtype=torch.float64)
    q = torch.tensor([[-1.0, 0.12]], dtype=torch.float64)
    hidden = torch.cat([torch.ones(1, 2, dtype=torch.float64), x, q])
    stage = one_image(hidden, before=1, after=1, prompt=Prompt(torch.arange(6).unsqueeze(0)))
    prune = prune_inputs(stage)
    assert kept_positions(prune, MMTok().select(prune, 1 - 1 / 4)) == [[3]]
    # without the question's id (excluded) only the image's own coverage is left
    alone = slow_max_coverage(slow_coverage_rows(x.tolist(), []), 1)
    assert kept_positions(prune, MMTok(exclude=(5,)).select(prune, 1 - 1 / 4)) == [[1 + alone[0]]]
    assert alone != [2]


@settings(max_examples=25, deadline=None)
@given(case=batches(max_side=6), ratio=st.sampled_from([0.0, 0.3, 0.7777777777777778]))
def test_rows_are_independent_with_a_prompt(case, ratio):
    ids = (torch.arange(case.layout.seq_len) * 7 % 11).expand(case.layout.batch_size, -1)
    inputs = StageInputs.of(
        case.layout, case.hidden, windows_per_side=1, removal_ratio=ratio, prompt=Prompt(ids)
    )
    assert_rows_independent(MMTok(), inputs, ratio)


@pytest.mark.parametrize("bad", [{"alpha": -1.0}, {"tau_tv": 0.0}, {"tau_vv": float("inf")}])
def test_parameters_are_checked(bad):
    with pytest.raises(ValueError):
        MMTok(**bad)
