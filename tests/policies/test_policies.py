"""Policy families: relevance against brute-force attention, schedulers, registries, errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lightkv
from lightkv import ImageSegment, Stage, VisionLayout
from lightkv.policies import (
    FAMILIES,
    EdgeScorer,
    ExplicitSchedule,
    KeptFractionSchedule,
    LastTokenAttention,
    Partitioner,
    Policy,
    QueryAxisSoftmax,
    StageSpec,
    UniformRelevance,
    average_kept_fraction,
)
from tests.strategies import batches


def _qk(case, heads=4, kv_heads=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, n = case.layout.batch_size, case.layout.seq_len
    return (
        torch.randn(b, heads, n, d, generator=gen),
        torch.randn(b, kv_heads, n, d, generator=gen),
    )


@given(case=batches())
def test_query_axis_softmax_equals_brute_force_full_attention(case):
    q, k = _qk(case)
    xi = QueryAxisSoftmax().score(q, k, case.layout)
    k_full = k.repeat_interleave(2, dim=1)
    logits = q @ k_full.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B,H,N,N], the N x N reference
    valid = case.layout.valid_mask
    logits = logits.masked_fill(~valid[:, None, :, None], float("-inf"))
    attn = torch.softmax(logits, dim=2)  # over queries
    text = case.layout.text_mask
    ref = (attn * text[:, None, None, :]).nan_to_num(0.0).sum(dim=(1, 3))
    ref = torch.where(case.layout.vision_mask, ref, torch.zeros_like(ref))
    torch.testing.assert_close(xi, ref, rtol=1e-5, atol=1e-6)


@given(case=batches())
def test_last_token_attention_equals_the_last_row_of_causal_attention(case):
    q, k = _qk(case, heads=2, kv_heads=2)
    xi = LastTokenAttention().score(q, k, case.layout)
    valid = case.layout.valid_mask
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    attn = torch.softmax(logits, dim=-1)
    for b in range(case.layout.batch_size):
        last = int(valid[b].nonzero().max())
        ref = attn[b, :, last].mean(0)
        ref = torch.where(case.layout.vision_mask[b], ref, torch.zeros_like(ref))
        torch.testing.assert_close(xi[b], ref, rtol=1e-5, atol=1e-7)


def test_uniform_relevance_needs_no_projections():
    lay = VisionLayout.from_segments(1, 6, [ImageSegment(0, 1, (2, 2))])
    assert UniformRelevance().score(None, None, lay).tolist() == [[0, 1, 1, 1, 1, 0]]
    assert UniformRelevance.query_rows == "none" and QueryAxisSoftmax.key_cols == "text"
    assert LastTokenAttention.query_rows == "last"


def test_relevance_shape_errors():
    lay = VisionLayout.from_segments(1, 6, [ImageSegment(0, 1, (2, 2))])
    with pytest.raises(ValueError, match="do not match the layout"):
        QueryAxisSoftmax().score(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), lay)
    with pytest.raises(ValueError, match="multiple of key heads"):
        QueryAxisSoftmax().score(torch.randn(1, 3, 6, 4), torch.randn(1, 2, 6, 4), lay)


def test_explicit_schedule_broadcasts_and_checks_depth():
    s = ExplicitSchedule(layers=(12, 18, 24), windows_per_side=(4, 2, 1), removal_ratios=(0.5,))
    assert [(x.layer, x.windows_per_side, x.removal_ratio) for x in s.plan(32)] == [
        (12, 4, 0.5),
        (18, 2, 0.5),
        (24, 1, 0.5),
    ]
    with pytest.raises(ValueError, match="only 16 layers"):
        s.plan(16)
    with pytest.raises(ValueError, match="give 1 or 3"):
        ExplicitSchedule(layers=(1, 2, 3), removal_ratios=(0.5, 0.5)).plan(8)
    with pytest.raises(ValueError, match="strictly increasing"):
        ExplicitSchedule(layers=(3, 2), windows_per_side=(1,)).plan(8)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\)"):
        StageSpec(layer=1, removal_ratio=1.0, windows_per_side=1)
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\)"):
        StageSpec(layer=1, removal_ratio=-0.1, windows_per_side=1)
    sizes = ExplicitSchedule(
        layers=(1, 2), windows_per_side=None, window_size=((2, 2), (4, 4))
    ).plan(4)
    assert [x.window_size for x in sizes] == [(2, 2), (4, 4)]


def test_average_kept_fraction_of_the_reference_llava_schedule():
    plan = ExplicitSchedule().plan(32)
    # 13 layers full, 6 at 1/2, 6 at 1/4, 7 at 1/8
    assert average_kept_fraction(plan, 32) == pytest.approx((13 + 3 + 1.5 + 7 / 8) / 32)


@given(target=st.floats(0.3, 1.0), depth=st.integers(2, 48))
def test_kept_fraction_schedule_hits_its_target_or_says_it_cannot(target, depth):
    schedule = KeptFractionSchedule(kept_fraction=target)
    try:
        plan = schedule.plan(depth)
    except ValueError as err:
        assert "out of reach" in str(err)
        # even the most aggressive placement (first stage after layer 0, max ratio) keeps more
        base = sorted({min(depth - 1, round(f * depth)) for f in schedule.relative_layers})
        tightest = [StageSpec(at - base[0], 0.5, windows_per_side=1) for at in base]
        assert average_kept_fraction(tightest, depth) > target
        return
    assert all(0 <= s.layer < depth and 0 <= s.removal_ratio <= 0.5 for s in plan)
    assert (average_kept_fraction(plan, depth) if plan else 1.0) == pytest.approx(target, abs=1e-5)


def test_kept_fraction_schedule_moves_stages_earlier_when_ratios_cannot_reach_the_target():
    # at 12/18/24 of 32 layers, ratio 0.5 (all of side A) keeps 0.574 > 0.55
    plan = KeptFractionSchedule(kept_fraction=0.55).plan(32)
    assert [s.layer for s in plan] == [11, 17, 23]
    assert average_kept_fraction(plan, 32) == pytest.approx(0.55, abs=1e-6)
    # with room in the ratio, the reference layers stay
    assert [s.layer for s in KeptFractionSchedule(kept_fraction=0.6).plan(32)] == [12, 18, 24]


def test_registries_list_name_and_create_policies():
    assert set(FAMILIES) == {"partitioner", "scorer", "pruner", "passer", "relevance", "scheduler"}
    assert {"grid", "pseudo_square", "global"} <= set(Partitioner.registered())
    assert {"cosine", "l2"} <= set(EdgeScorer.registered())
    for family in FAMILIES.values():
        assert len(family.registered()) >= 2, family.family  # LightKV + at least one alternative
    assert Partitioner.create("grid", split="checkerboard").params() == {
        "split": "checkerboard",
        "src_parity": 0,
        "seed": 0,
        "bands": "proportional",
        "min_tokens_per_window": 0,
        "min_kept_per_window": 0,
    }
    with pytest.raises(ValueError, match="unknown partitioner 'hexagonal'") as err:
        Partitioner.lookup("hexagonal")
    listed = str(err.value).split("registered partitioners: ")[1].split(", ")
    assert listed == sorted(listed)  # the message lists every name, sorted
    assert {"global", "grid", "pseudo_square"} <= set(listed)
    with pytest.raises(ValueError, match="has no parameter"):
        Partitioner.create("grid", windows=3)


def test_register_decorator_adds_a_user_policy_usable_in_a_stage():
    from dataclasses import dataclass

    @EdgeScorer.register("test_manhattan")
    @dataclass
    class Manhattan(EdgeScorer):
        def divergence(self, src, dst):
            return (src.unsqueeze(2) - dst.unsqueeze(1)).abs().sum(-1)

    assert EdgeScorer.lookup("test_manhattan") is Manhattan
    lay = VisionLayout.from_segments(1, 18, [ImageSegment(0, 1, (4, 4))])
    out = Stage(StageSpec(0, 0.5, windows_per_side=2), scorer=EdgeScorer.create("test_manhattan"))(
        torch.randn(1, 18, 3), lay
    )
    assert int(out.layout.vision_counts()) == 8
    with pytest.raises(ValueError, match="already registered"):

        @EdgeScorer.register("test_manhattan")
        @dataclass
        class Other(EdgeScorer):
            pass

    with pytest.raises(TypeError, match="must subclass EdgeScorer"):
        EdgeScorer.register("test_bad")(Policy)


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown preset 'lightkvv'; available presets: .*lightkv"):
        lightkv.load("lightkvv")
