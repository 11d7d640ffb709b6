"""`relevance: random` reproduces the released code's distribution (issue 40 item 10).

The released LLaVA hook replaces the relevance module's attention scores by
``torch.rand_like``; the module then takes its softmax over the query axis and sums over
text columns and heads, which makes ξ nearly constant. lightkv used to take the uniform
draw itself as ξ (coefficient of variation 0.6), so its merged features landed tens of
times further from the released code's than two released runs from each other. Checked
here against an independent re-derivation of the released formula with the global RNG.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import lightkv
from lightkv import ImageSegment, VisionLayout
from lightkv.policies import RandomRelevance

H, D = 32, 16  # LLaVA-1.5-7B's heads (the released code sums over them)


def _layout(rows=1, before=5, after=9):
    n = before + 576 + after
    return VisionLayout.from_segments(
        rows, n, [ImageSegment(row=r, offset=before, grid=(24, 24)) for r in range(rows)]
    )


def _released(layout: VisionLayout, seed: int) -> torch.Tensor:
    """The released module with its scores replaced: rand_like over [B, H, N, T] scores,
    softmax over the query axis (every token), sum over text columns and heads."""
    b, n = layout.batch_size, layout.seq_len
    t = int(layout.text_mask.sum(1).max())
    scores = torch.rand(
        b, H, n, t, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    xi = torch.softmax(scores, dim=2).sum(dim=(1, 3))
    return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))


def _lightkv(layout: VisionLayout, seed: int = 0) -> torch.Tensor:
    queries = torch.zeros(layout.batch_size, H, layout.seq_len, D)  # read for the head count only
    return RandomRelevance(seed=seed).score(queries, None, layout)


def _cv(xi: torch.Tensor, layout: VisionLayout) -> float:
    v = xi[layout.vision_mask]
    return float(v.std() / v.mean())


def test_the_spread_of_xi_is_the_released_codes():
    layout = _layout()
    released = [_cv(_released(layout, s), layout) for s in range(3)]
    ours = _cv(_lightkv(layout), layout)
    assert max(released) < 0.03 and ours == pytest.approx(sum(released) / 3, rel=0.15)
    raw = _cv(RandomRelevance(softmax=False).score(None, None, layout), layout)
    assert raw > 0.5  # the draw itself, what lightkv merged with before


def test_merged_features_are_within_the_released_codes_run_to_run_spread():
    layout = _layout()
    stage = lightkv.load("lightkv-paper-released").stages(num_layers=32)[0]
    hidden = torch.randn(
        1, layout.seq_len, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    released = [stage(hidden, layout, _released(layout, s)).hidden for s in range(4)]
    spread = max(float((a - b).norm()) for a, b in itertools.combinations(released, 2))
    ours = stage(hidden, layout, _lightkv(layout)).hidden
    assert max(float((ours - r).norm()) for r in released) <= 1.5 * spread
    raw = stage(hidden, layout, RandomRelevance(softmax=False).score(None, None, layout)).hidden
    assert (
        min(float((raw - r).norm()) for r in released) > 10 * spread
    )  # the old draw: far outside it


def test_a_row_draws_the_same_alone_and_left_padded_in_a_batch():
    alone = VisionLayout.from_segments(1, 30, [ImageSegment(0, 3, (4, 5))])
    pad = torch.zeros(2, 34, dtype=torch.bool)
    pad[0, :4] = True  # row 0: the same prompt, left-padded by 4
    both = VisionLayout.from_segments(
        2, 34, [ImageSegment(0, 7, (4, 5)), ImageSegment(1, 3, (4, 5))], padding_mask=pad
    )
    xi_alone = _lightkv(alone)[0]
    xi_both = _lightkv(both)
    torch.testing.assert_close(xi_both[0, 4:], xi_alone, rtol=1e-12, atol=1e-15)
    assert bool((xi_both[0, :4] == 0).all())
    assert not torch.equal(_lightkv(alone, seed=1), _lightkv(alone))
    assert torch.equal(_lightkv(alone), _lightkv(alone))  # every run
