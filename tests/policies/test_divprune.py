"""DivPrune against a slow greedy written from the definition (max-min cosine distance)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv.methods import DivPrune
from lightkv.policies import StageInputs
from tests.policies.keep_set_cases import kept_positions, one_image, prune_inputs
from tests.strategies import batches


def _distance(x: torch.Tensor, i: int, j: int) -> float:
    a, b = x[i].tolist(), x[j].tolist()
    dot = sum(p * q for p, q in zip(a, b))
    return 1.0 - dot / (math.sqrt(sum(p * p for p in a)) * math.sqrt(sum(q * q for q in b)))


def slow_divprune(x: torch.Tensor, keep: int) -> list[int]:
    """The picks in order: first the token whose nearest other token is farthest, then
    each time the token farthest (min distance) from the picks; ties: the earliest."""
    n = x.shape[0]
    picks: list[int] = []
    for step in range(keep):
        best, best_j = -math.inf, -1
        for j in range(n):
            if j in picks:
                continue
            others = [i for i in range(n) if i != j] if step == 0 else picks
            score = min((_distance(x, i, j) for i in others), default=math.inf)
            if score > best:
                best, best_j = score, j
        picks.append(best_j)
    return picks


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 14), dim=st.integers(2, 6), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_equals_the_slow_greedy(n, dim, seed, data):
    keep = data.draw(st.integers(0, n))
    hidden = torch.randn(
        n + 3, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    prune = prune_inputs(one_image(hidden))
    removed = DivPrune().select(prune, 1 - keep / n)
    picks = slow_divprune(hidden[1 : 1 + n], keep)
    assert kept_positions(prune, removed) == [sorted(1 + p for p in picks)]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 8), seed=st.integers(0, 2**31 - 1))
def test_kept_sets_are_nested_and_every_step_maximises_the_min_distance(n, seed):
    """Exhaustively on small windows: the kept set for ``c`` tokens is the one for ``c - 1``
    plus one token, and that token maximises the min distance to the others kept (over
    every candidate; the first over the nearest other token)."""
    hidden = torch.randn(
        n + 3, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    x = hidden[1 : 1 + n]
    prune = prune_inputs(one_image(hidden))
    previous: set[int] = set()
    for c in range(1, n + 1):
        kept = {p - 1 for p in kept_positions(prune, DivPrune().select(prune, 1 - c / n))[0]}
        added = kept - previous
        assert previous <= kept and len(added) == 1
        (j,) = added

        def score(t):
            others = [i for i in range(n) if i != t] if not previous else sorted(previous)  # noqa: B023 (called in this iteration)
            return min((_distance(x, i, t) for i in others), default=math.inf)

        scores = {t: score(t) for t in range(n) if t not in previous}
        assert scores[j] == max(scores.values())
        assert j == min(t for t, s in scores.items() if s == scores[j])  # ties: the earliest
        previous = kept


def test_duplicates_are_dropped_first_and_ties_go_to_the_earliest():
    # tokens 0 and 2 are the same direction, 1 and 3 too: keeping 2 keeps one of each
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 3.0]], dtype=torch.float64)
    hidden = torch.cat([torch.ones(1, 2), x, torch.ones(2, 2)]).double()
    prune = prune_inputs(one_image(hidden))
    assert kept_positions(prune, DivPrune().select(prune, 0.5)) == [[1, 2]]


@settings(max_examples=20, deadline=None)
@given(case=batches(max_side=5))
def test_keys_features_equal_hidden_features_of_the_same_values(case):
    keys = case.hidden.view(*case.hidden.shape[:2], 2, 3)
    a = StageInputs.of(case.layout, case.hidden, windows_per_side=1, key_states=keys)
    b = StageInputs.of(
        case.layout, torch.randn_like(case.hidden), windows_per_side=1, key_states=keys
    )  # hidden unused
    got_hidden = DivPrune().select(prune_inputs(a), 0.6)
    got_keys = DivPrune(features="key_states").select(prune_inputs(b), 0.6)
    assert torch.equal(got_hidden, got_keys)
    assert (
        DivPrune(features="key_states").needs == {"key_states"} and DivPrune().needs == frozenset()
    )
