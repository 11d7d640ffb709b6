"""DART against a slow reference written from the paper/code's rule: key-norm pivots, then
per pivot the least similar remaining image tokens."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv.methods import DART
from lightkv.policies import StageInputs
from tests.policies.keep_set_cases import assert_rows_independent, kept_positions, prune_inputs
from tests.strategies import batches


def _cos(a: list[float], b: list[float]) -> float:
    dot = sum(p * q for p, q in zip(a, b))
    return dot / (math.sqrt(sum(p * p for p in a)) * math.sqrt(sum(q * q for q in b)))


def slow_dart(
    hidden,
    keys,
    image: list[int],
    question: list[int],
    keep: int,
    p_img: int,
    p_txt: int,
    at: dict[int, int] | None = None,
) -> list[int]:
    """Positions kept of one image; ``hidden [N, D]``, ``keys [N, H, d]`` of its row. With
    ``at`` (a position's index in the unpadded row) the pivots are visited in the order of a
    Python set of those indices (the authors' code), else image pivots then question pivots."""
    l1 = {p: sum(abs(v) for v in keys[p].flatten().tolist()) for p in image + question}
    n_img = min(p_img, keep)
    img_piv = sorted(image, key=lambda p: (-l1[p], p))[:n_img]
    txt_piv = sorted(question, key=lambda p: (-l1[p], p))[:p_txt]
    pivots = img_piv + txt_piv
    if at is not None:
        back = {at[p]: p for p in pivots}
        pivots = [back[i] for i in set(at[p] for p in pivots)]
    picks = keep - n_img
    kept = list(img_piv)
    for i, pivot in enumerate(pivots):
        quota = picks // len(pivots) + (1 if i < picks % len(pivots) else 0)
        free = [p for p in image if p not in kept]
        free.sort(key=lambda p: (_cos(hidden[p].tolist(), hidden[pivot].tolist()), p))
        kept += free[:quota]
    return sorted(kept)


@settings(max_examples=40, deadline=None)
@given(
    case=batches(max_side=6),
    ratio=st.sampled_from([0.3, 0.5, 0.7777777777777778, 0.95]),
    p_img=st.integers(1, 5),
    p_txt=st.integers(0, 5),
    order=st.sampled_from(["set", "norm"]),
)
def test_equals_the_slow_reference(case, ratio, p_img, p_txt, order):
    keys = torch.randn(
        *case.hidden.shape[:2],
        2,
        3,
        generator=torch.Generator().manual_seed(1),
        dtype=torch.float64,
    )
    stage = StageInputs.of(case.layout, case.hidden, windows_per_side=1, key_states=keys)
    prune = prune_inputs(stage)
    got = kept_positions(
        prune,
        DART(pivot_image_tokens=p_img, pivot_text_tokens=p_txt, pivot_order=order).select(
            prune, ratio
        ),
    )
    layout, graph = case.layout, prune.graph
    for w in range(graph.num_windows):
        slots = graph.src_slots[w][graph.src_slots[w] >= 0]
        row = int(graph.node_row[slots[0]])
        image = graph.node_pos[slots].tolist()
        last = max(p for p in range(layout.seq_len) if layout.vision_mask[row, p])
        question = [p for p in range(last + 1, layout.seq_len) if layout.text_mask[row, p]]
        keep = len(image) - math.floor(len(image) * ratio + 1e-9)
        valid = [p for p in range(layout.seq_len) if layout.valid_mask[row, p]]
        at = {p: i for i, p in enumerate(valid)} if order == "set" else None
        assert got[w] == slow_dart(
            case.hidden[row], keys[row], image, question, keep, p_img, p_txt, at
        ), f"window {w}"


@settings(max_examples=20, deadline=None)
@given(case=batches(max_side=6), ratio=st.sampled_from([0.5, 0.7777777777777778]))
def test_rows_are_independent_with_hidden_pivots(case, ratio):
    inputs = StageInputs.of(case.layout, case.hidden, windows_per_side=1, removal_ratio=ratio)
    assert_rows_independent(DART(pivot_features="hidden"), inputs, ratio)


def test_the_least_duplicated_tokens_stay():
    # 1x6 image: token 0 has the largest key norm (the pivot); tokens 1-4 repeat its
    # direction, token 5 is orthogonal: keeping 2 keeps the pivot and token 5.
    from lightkv import ImageSegment, VisionLayout

    layout = VisionLayout.from_segments(1, 8, [ImageSegment(row=0, offset=0, grid=(1, 6))])
    hidden = torch.tensor(
        [[1.0, 0.0]] * 5 + [[0.0, 1.0]] + [[1.0, 1.0]] * 2, dtype=torch.float64
    ).unsqueeze(0)
    keys = torch.ones(1, 8, 1, 2, dtype=torch.float64)
    keys[0, 0] = 5.0
    stage = StageInputs.of(layout, hidden, windows_per_side=1, key_states=keys)
    prune = prune_inputs(stage)
    assert kept_positions(
        prune, DART(pivot_image_tokens=1, pivot_text_tokens=0).select(prune, 1 - 2 / 6)
    ) == [[0, 5]]


def test_parameters_are_checked_and_keys_are_needed():
    with pytest.raises(ValueError, match="pivot_image_tokens must be an integer >= 1"):
        DART(pivot_image_tokens=0)
    with pytest.raises(ValueError, match="pivot_text_tokens"):
        DART(pivot_text_tokens=-1)
    with pytest.raises(ValueError, match="unknown pivot_order 'hash'; choose set or norm"):
        DART(pivot_order="hash")
    assert DART().needs == {"key_states"} and DART(pivot_features="hidden").needs == frozenset()
