"""CDPruner: the conditional kernel's relevance against a loop oracle, the incremental
Cholesky greedy against a determinant greedy, uniform relevance as a plain DPP."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv.methods import CDPruner
from lightkv.policies import Prompt, StageInputs
from tests.policies.keep_set_cases import (
    assert_rows_independent,
    kept_positions,
    one_image,
    prune_inputs,
    slow_cos,
)
from tests.strategies import batches


def slow_quality(
    tokens: list[list[float]], question: list[list[float]], negate=False, theta=None
) -> list[float]:
    """The paper/code's relevance, one token at a time: mean cosine to the question's
    tokens, (negated,) min-max normalised with +1e-6, (exp(alpha q))."""
    if not question:
        return [1.0] * len(tokens)
    r = [sum(slow_cos(x, t) for t in question) / len(question) for x in tokens]
    if negate:
        r = [-v for v in r]
    lo, hi = min(r), max(r)
    q = [(v - lo + 1e-6) / (hi - lo) for v in r] if hi > lo else [1.0] * len(r)
    if theta is not None:
        q = [math.exp(theta / (2 * (1 - theta)) * v) for v in q]
    return q


def slow_dpp_greedy(tokens: list[list[float]], q: list[float], keep: int) -> list[int]:
    """Each step adds the token that maximises det(L_S) (torch.linalg.det, float64)."""
    n = len(tokens)
    cos = [[1.0 if i == j else slow_cos(tokens[i], tokens[j]) for j in range(n)] for i in range(n)]
    kernel = torch.tensor(
        [[q[i] * cos[i][j] * q[j] for j in range(n)] for i in range(n)], dtype=torch.float64
    )
    picks: list[int] = []
    for _ in range(keep):
        best, best_i = -math.inf, -1
        for i in range(n):
            if i in picks:
                continue
            s = picks + [i]
            det = float(torch.linalg.det(kernel[s][:, s]))
            if det > best:
                best, best_i = det, i
        picks.append(best_i)
    return picks


def _case(n: int, dim: int, seed: int, question: int = 3):
    hidden = torch.randn(
        1 + n + question, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    ids = torch.arange(hidden.shape[0]).unsqueeze(0)
    return hidden, one_image(hidden, before=1, after=question, prompt=Prompt(ids))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 7),
    seed=st.integers(0, 2**31 - 1),
    negate=st.booleans(),
    theta=st.sampled_from([None, 0.0, 0.3, 0.8]),
    data=st.data(),
)
def test_greedy_map_equals_the_determinant_greedy(n, seed, negate, theta, data):
    keep = data.draw(st.integers(0, n))
    hidden, stage = _case(n, dim=8, seed=seed)  # n <= dim: the kernel has full rank
    tokens, question = hidden[1 : 1 + n].tolist(), hidden[1 + n :].tolist()
    q = slow_quality(tokens, question, negate, theta)
    prune = prune_inputs(stage)
    pruner = CDPruner(negate=negate, theta=theta)
    removed = pruner.select(prune, 1 - keep / n)
    assert kept_positions(prune, removed) == [
        sorted(1 + p for p in slow_dpp_greedy(tokens, q, keep))
    ]


@settings(max_examples=30, deadline=None)
@given(case=batches(max_side=5), negate=st.booleans(), theta=st.sampled_from([None, 0.5]))
def test_relevance_equals_the_loop_oracle(case, negate, theta):
    ids = torch.arange(case.layout.seq_len).expand(case.layout.batch_size, -1)
    stage = StageInputs.of(case.layout, case.hidden, windows_per_side=1, prompt=Prompt(ids))
    prune = prune_inputs(stage)
    got = CDPruner(negate=negate, theta=theta).quality(prune, stage)
    question = Prompt(ids).question_mask(case.layout)
    graph = prune.graph
    for w in range(graph.num_windows):
        slots = graph.src_slots[w][graph.src_slots[w] >= 0]
        row = int(graph.node_row[slots[0]])
        tokens = [case.hidden[row, int(p)].tolist() for p in graph.node_pos[slots]]
        quest = [
            case.hidden[row, p].tolist() for p in range(case.layout.seq_len) if question[row, p]
        ]
        want = slow_quality(tokens, quest, negate, theta)
        if (
            len(tokens) == 1 or not quest
        ):  # constant relevance or no question: uniform (1, or exp(alpha) with theta)
            want = [1.0 if theta is None else math.exp(theta / (2.0 * (1.0 - theta)))] * len(tokens)
        torch.testing.assert_close(
            got[w, : len(tokens)], torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9
        )


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 7), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_uniform_relevance_is_the_plain_dpp(n, seed, data):
    keep = data.draw(st.integers(0, n))
    hidden, stage = _case(n, dim=8, seed=seed)
    no_prompt = one_image(hidden, before=1, after=3)
    tokens = hidden[1 : 1 + n].tolist()
    want = [sorted(1 + p for p in slow_dpp_greedy(tokens, [1.0] * n, keep))]
    for pruner, inputs in ((CDPruner(), no_prompt), (CDPruner(theta=0.0), stage)):
        prune = prune_inputs(inputs)
        assert kept_positions(prune, pruner.select(prune, 1 - keep / n)) == want


@settings(max_examples=25, deadline=None)
@given(case=batches(max_side=6), ratio=st.sampled_from([0.3, 0.7777777777777778]))
def test_rows_are_independent_with_a_prompt(case, ratio):
    ids = (torch.arange(case.layout.seq_len) * 7 % 11).expand(case.layout.batch_size, -1)
    inputs = StageInputs.of(
        case.layout, case.hidden, windows_per_side=1, removal_ratio=ratio, prompt=Prompt(ids)
    )
    assert_rows_independent(CDPruner(), inputs, ratio)


def test_duplicates_exhaust_the_dpp_and_the_rest_go_by_relevance():
    # Tokens 1..3 repeat token 0's direction: after token 0 and token 4 nothing adds volume.
    x = torch.tensor(
        [[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [0.5, 0.0], [0.0, 1.0]], dtype=torch.float64
    )
    hidden = torch.cat(
        [torch.ones(1, 2, dtype=torch.float64), x, torch.ones(2, 2, dtype=torch.float64)]
    )
    prune = prune_inputs(one_image(hidden))
    assert kept_positions(prune, CDPruner().select(prune, 1 - 2 / 5)) == [[1, 5]]
    # a third pick: every gain is 0, uniform q, so the earliest free token
    assert kept_positions(prune, CDPruner().select(prune, 1 - 3 / 5)) == [[1, 2, 5]]


def test_theta_is_checked():
    with pytest.raises(ValueError, match="theta"):
        CDPruner(theta=1.0)
