"""VisPruner against a slow reference written from the authors' ``encode_images`` loop."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv import ImageSegment, VisionLayout
from lightkv.methods import VisPruner
from lightkv.policies import StageInputs
from lightkv.testing import check_policy
from tests.policies.keep_set_cases import (
    assert_rows_independent,
    kept_positions,
    one_image,
    prune_inputs,
)


def _cos(x: torch.Tensor, i: int, j: int) -> float:
    a, b = x[i].tolist(), x[j].tolist()
    return sum(p * q for p, q in zip(a, b)) / (
        math.sqrt(sum(p * p for p in a)) * math.sqrt(sum(q * q for q in b))
    )


def slow_vispruner(
    x: torch.Tensor, xi: list[float], keep: int, important: float = 0.5, step: int = 8
) -> list[int]:
    """Python lists, one step at a time: the important tokens by relevance (descending,
    earlier first on ties), then rounds that drop the ``r`` even-position tokens of the
    residual list most similar to an odd-position token."""
    n = x.shape[0]
    ranked = sorted(range(n), key=lambda i: (-xi[i], i))
    n_imp = math.floor(keep * important)
    n_div = keep - n_imp
    important_set, residual = ranked[:n_imp], ranked[n_imp:]
    while True:
        r = min(step, len(residual) - n_div)
        if r <= 0:
            break
        a, b = residual[0::2], residual[1::2]
        scores = [max((_cos(x, i, j) for j in b), default=-math.inf) for i in a]
        by_score = sorted(range(len(a)), key=lambda p: (-scores[p], p))
        residual = [a[p] for p in by_score[r:]] + b
    return sorted(important_set + residual)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), dim=st.integers(2, 6), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_equals_the_slow_reference(n, dim, seed, data):
    keep = data.draw(st.integers(1, n))
    step = data.draw(st.integers(1, 9))
    important = data.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n + 3, dim, generator=g, dtype=torch.float64)
    xi = torch.rand(n, generator=g, dtype=torch.float64)
    prune = prune_inputs(one_image(hidden))
    seq_xi = torch.cat([torch.zeros(1), xi.float(), torch.zeros(2)]).unsqueeze(
        0
    )  # [1, N]: the image's xi
    prune = replace(prune, relevance=prune.graph.blocks(prune.graph.gather(seq_xi), "src"))
    removed = VisPruner(important=important, step=step).select(prune, 1 - keep / n)
    want = slow_vispruner(hidden[1 : 1 + n], xi.float().tolist(), keep, important, step)
    assert kept_positions(prune, removed) == [[1 + p for p in want]]


def test_keeps_the_most_relevant_half_whole():
    hidden = torch.randn(40 + 3, 4, generator=torch.Generator().manual_seed(0))
    xi = torch.zeros(43)
    xi[[3, 9, 20, 31]] = 1.0
    stage_inputs = one_image(hidden, relevance=xi.unsqueeze(0))
    prune = prune_inputs(stage_inputs)
    prune = replace(prune, relevance=prune.graph.blocks(prune.graph.gather(xi.unsqueeze(0)), "src"))
    removed = VisPruner().select(prune, 1 - 8 / 40)
    kept = kept_positions(prune, removed)[0]
    assert len(kept) == 8 and {3, 9, 20, 31} <= set(kept)


def test_rows_are_independent_and_the_contract_holds():
    hidden = torch.randn(2, 44, 6, generator=torch.Generator().manual_seed(3))
    layout = VisionLayout.from_segments(
        2,
        44,
        [
            ImageSegment(row=0, offset=2, grid=(6, 6)),
            ImageSegment(row=1, offset=1, grid=(4, 8)),
            ImageSegment(row=1, offset=34, grid=(2, 4)),
        ],
    )
    xi = torch.rand(2, 44, generator=torch.Generator().manual_seed(4))
    assert_rows_independent(
        VisPruner(), StageInputs.of(layout, hidden, windows_per_side=1, relevance=xi), 0.8
    )
    check_policy(VisPruner)
    check_policy(VisPruner, important=0.0, step=1)
    with pytest.raises(ValueError, match="important"):
        VisPruner(important=1.5)
    with pytest.raises(ValueError, match="step"):
        VisPruner(step=0)
