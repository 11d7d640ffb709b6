"""HoloV against a slow loop written from the paper's crop scores and budget rule (the authors'
``HoloV`` function step by step): a crop whose share exceeds its size keeps all its tokens and
the image's remaining slots become zero vectors (the code's padding), or with ``overflow:
spread`` (lightkv's variant) the excess goes to the crops not yet full."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv.methods import HoloV
from lightkv.policies import StageInputs
from tests.policies.keep_set_cases import (
    assert_rows_independent,
    kept_positions,
    one_image,
    prune_inputs,
)
from tests.strategies import batches


def slow_crops(n: int, crops: int) -> list[list[int]]:
    """Runs of consecutive tokens: ``n // crops + 1`` for the first ``n % crops``, then
    ``n // crops``; empty runs dropped."""
    out, start = [], 0
    for p in range(crops):
        size = n // crops + (1 if p < n % crops else 0)
        if size:
            out.append(list(range(start, start + size)))
        start += size
    return out


def slow_holov(
    tokens, saliency, keep, crops=16, alpha=0.09, scale=1e3, eps=1e-6, overflow="pad"
) -> list[int]:
    """The kept tokens' indices (with ``pad``: the real ones; ``keep`` minus their number are
    zero vectors)."""
    unit = [[v / (math.sqrt(sum(u * u for u in t)) + eps) for v in t] for t in tokens]
    runs = slow_crops(len(tokens), crops)
    scores = []
    for run in runs:
        c = len(run)
        if c == 1:
            scores.append(saliency[run[0]])  # a one-token crop: its unscaled saliency
            continue
        s = {
            (i, j): 0.0 if i == j else sum(a * b for a, b in zip(unit[i], unit[j]))
            for i in run
            for j in run
        }
        mu = {i: sum(s[i, j] for j in run) / (c - 1) for i in run}
        var = {i: sum((s[i, j] - mu[i]) ** 2 for j in run) / (c - 1) for i in run}
        att = {i: saliency[i] * scale for i in run}
        ratio = (sum(abs(att[i]) for i in run) / c) / (sum(abs(var[i]) for i in run) / c + eps)
        scores.append(sum(att[i] + alpha * var[i] * ratio for i in run) / c)
    total = sum(scores)
    weights = [s / (total + eps) for s in scores]
    share = [math.floor(w * keep) for w in weights]
    left = keep - sum(share)
    by_weight = sorted(range(len(runs)), key=lambda p: (-weights[p], p))
    for p in by_weight[: max(left, 0)]:
        share[p] += 1
    # a share exceeding its crop is capped; lightkv's spread then hands the excess out one token
    # at a time to the crops not yet full, earliest first (round after round)
    share = [min(s, len(run)) for s, run in zip(share, runs)]
    while overflow == "spread" and sum(share) < keep:
        for p, run in enumerate(runs):
            if sum(share) < keep and share[p] < len(run):
                share[p] += 1
    picks = []
    for run, s in zip(runs, share):
        ranked = sorted(run, key=lambda i: (-saliency[i], i))
        picks += ranked[:s]
    return picks


def _with_relevance(stage: StageInputs, relevance: torch.Tensor):
    prune = prune_inputs(replace(stage, relevance=relevance))
    return replace(prune, relevance=prune.graph.token_blocks(relevance, "src"))


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 40),
    dim=st.integers(2, 5),
    crops=st.sampled_from([1, 3, 4, 16]),
    seed=st.integers(0, 2**31 - 1),
    ties=st.booleans(),
    overflow=st.sampled_from(["pad", "spread"]),
    data=st.data(),
)
def test_equals_the_slow_loop(n, dim, crops, seed, ties, overflow, data):
    keep = data.draw(st.integers(0, n))
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n + 3, dim, generator=gen, dtype=torch.float64)
    relevance = torch.rand(1, n + 3, generator=gen, dtype=torch.float64)
    if ties:  # a few saliency levels: in-crop ties go to the earliest token
        relevance = torch.floor(relevance * 3) / 3
    prune = _with_relevance(one_image(hidden), relevance)
    removed, zeroed = HoloV(crops=crops, overflow=overflow).choose(prune, 1 - keep / n)
    picks = slow_holov(
        hidden[1 : 1 + n].tolist(), relevance[0, 1 : 1 + n].tolist(), keep, crops, overflow=overflow
    )
    dropped = [p for p in range(n) if p not in picks]
    pads = dropped[len(dropped) - (keep - len(picks)) :] if keep > len(picks) else []
    if keep == n:  # nothing to remove: the image stays whole (the code would still run)
        assert zeroed is None and not removed.any()
        return
    assert kept_positions(prune, removed | zeroed) == [sorted(1 + p for p in picks)]
    assert kept_positions(prune, ~zeroed) == [sorted(1 + p for p in pads)]


def test_the_budget_follows_the_crop_scores():
    # 8 tokens, 2 crops of 4; the second crop's saliency is 3x the first's: of 4 kept, 3 go there
    hidden = torch.randn(11, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    relevance = torch.tensor([[0.0, 1, 1, 1, 1, 3, 3, 3, 3, 0, 0]], dtype=torch.float64)
    prune = _with_relevance(one_image(hidden), relevance)
    kept = kept_positions(prune, HoloV(crops=2, alpha=0.0).select(prune, 0.5))[0]
    assert sum(p <= 4 for p in kept) == 1 and sum(p >= 5 for p in kept) == 3


@settings(max_examples=25, deadline=None)
@given(case=batches(max_side=6), ratio=st.sampled_from([0.0, 0.3, 0.7777777777777778]))
def test_rows_are_independent_with_relevance(case, ratio):
    inputs = StageInputs.of(
        case.layout, case.hidden, windows_per_side=1, removal_ratio=ratio, relevance=case.relevance
    )
    assert_rows_independent(HoloV(crops=4), inputs, ratio)


@pytest.mark.parametrize("bad", [{"crops": 0}, {"alpha": -1.0}, {"eps": float("nan")}])
def test_parameters_are_checked(bad):
    with pytest.raises(ValueError):
        HoloV(**bad)
