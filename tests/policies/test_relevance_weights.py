"""Size-aware messages (``relevance_size_mean``) and the relevance variants (``heads``,
``text_attention``) of issue 16, against loop oracles and brute-force attention."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv import ImageSegment, Stage, VisionLayout
from lightkv.config import PipelineConfig
from lightkv.policies import (
    LastTokenAttention,
    QueryAxisSoftmax,
    RelevanceSizeWeightedMean,
    RelevanceWeightedMean,
    SizeWeightedMean,
    StageSpec,
    TextQueryAttention,
)
from tests.strategies import batches, ratios

POWERS = st.sampled_from([0.0, 0.5, 1.0, 2.0])


# ---------------------------------------------------------------- relevance_size_mean


def two_stages(case, passer, ratio, wps):
    """Two stages as `Pipeline.run` chains them: survivors keep their own relevance."""
    first = Stage(StageSpec(0, ratio, windows_per_side=wps), passer=passer)(
        case.hidden, case.layout, case.relevance
    )
    hole = first.kept_index < 0
    xi2 = case.relevance.gather(1, first.kept_index.clamp_min(0)).masked_fill(hole, 0)
    second = Stage(StageSpec(1, ratio, windows_per_side=max(wps - 1, 1)), passer=passer)(
        first.hidden, first.layout, xi2, first.provenance
    )
    return first, xi2, second


def oracle_coefficients(case, first, xi2, second, a, s):
    """Per row: {final column: {original position: coefficient}}, from the stages' remaps
    alone, with weights ``ξ^a · size^s`` written out per group."""
    out = []
    for b in range(case.layout.batch_size):
        coeff = {i: {i: 1.0} for i in range(case.layout.seq_len)}
        size = {i: 1 for i in coeff}
        for remap, xi, kept in (
            (first.remap, case.relevance, None),
            (second.remap, xi2, first.kept_index),
        ):
            groups: dict[int, list[int]] = {}
            for i, target in enumerate(remap[b].tolist()):
                if kept is None or kept[b, i] >= 0:  # holes represent nothing
                    groups.setdefault(target, []).append(i)
            new_coeff, new_size = {}, {}
            for target, members in groups.items():
                w = [float(xi[b, t]) ** a * size[t] ** s for t in members]
                if sum(w) <= 0:
                    w = [1.0] * len(members)
                mixed: dict[int, float] = {}
                for wt, t in zip(w, members):
                    for o, c in coeff[t].items():
                        mixed[o] = mixed.get(o, 0.0) + wt * c / sum(w)
                new_coeff[target], new_size[target] = mixed, sum(size[t] for t in members)
            coeff, size = new_coeff, new_size
        out.append(coeff)
    return out


@settings(max_examples=50)
@given(
    case=batches(),
    ratio=st.sampled_from([0.25, 0.5, 0.7]),
    wps=st.integers(1, 3),
    a=POWERS,
    s=POWERS,
)
def test_two_stages_give_the_oracles_convex_combination_of_originals(case, ratio, wps, a, s):
    first, xi2, second = two_stages(
        case, RelevanceSizeWeightedMean(relevance_power=a, size_power=s), ratio, wps
    )
    for b, coeff in enumerate(oracle_coefficients(case, first, xi2, second, a, s)):
        for j, mixed in coeff.items():
            assert all(c >= 0 for c in mixed.values()) and math.isclose(
                sum(mixed.values()), 1.0, rel_tol=1e-12
            )
            expected = sum(c * case.hidden[b, o] for o, c in mixed.items())
            torch.testing.assert_close(second.hidden[b, j], expected, rtol=0, atol=1e-10)


@settings(max_examples=50)
@given(case=batches(), ratio=ratios, wps=st.integers(1, 3))
def test_the_powers_give_relevance_mean_and_size_mean(case, ratio, wps):
    for mine, theirs in (
        (RelevanceSizeWeightedMean(size_power=0.0), RelevanceWeightedMean()),
        (RelevanceSizeWeightedMean(relevance_power=0.0), SizeWeightedMean()),
    ):
        got = two_stages(case, mine, ratio, wps)[2]
        ref = two_stages(case, theirs, ratio, wps)[2]
        assert torch.equal(got.kept_index, ref.kept_index)
        torch.testing.assert_close(got.hidden, ref.hidden, rtol=0, atol=1e-12)


def test_a_large_relevant_group_is_not_diluted_by_a_small_one():
    # sources 0 and 1 (sizes 3 and 1) merge into destination 2 (size 1)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    xi = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)
    size = torch.tensor([3, 1, 1])
    src, dst = torch.tensor([0, 1]), torch.tensor([2, 2])
    _, mine = RelevanceSizeWeightedMean()(x, xi, size, src, dst)
    _, plain = RelevanceWeightedMean()(x, xi, size, src, dst)
    torch.testing.assert_close(mine[0], torch.tensor([3 / 6, 1 / 6], dtype=torch.float64))
    torch.testing.assert_close(plain[0], torch.tensor([1 / 4, 1 / 4], dtype=torch.float64))


def test_relevance_size_mean_checks_its_powers():
    for bad in ({"relevance_power": -1.0}, {"size_power": float("nan")}, {"size_power": True}):
        with pytest.raises(ValueError, match="power"):
            RelevanceSizeWeightedMean(**bad)


# ---------------------------------------------------------------- relevance variants


def _qk(case, heads=4, kv_heads=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, n = case.layout.batch_size, case.layout.seq_len
    return (
        torch.randn(b, heads, n, d, generator=gen, dtype=torch.float64),
        torch.randn(b, kv_heads, n, d, generator=gen, dtype=torch.float64),
    )


def _per_head(attn_rows_summed, heads):
    """``[B, H, N]`` -> ``[B, N]`` written out per option."""
    return {
        "sum": attn_rows_summed.sum(1),
        "mean": attn_rows_summed.sum(1) / attn_rows_summed.shape[1],
        "max": attn_rows_summed.max(1).values,
    }[heads]


@pytest.mark.parametrize("heads", ["sum", "mean", "max"])
@settings(max_examples=30)
@given(case=batches())
def test_query_softmax_heads_against_full_attention(heads, case):
    q, k = _qk(case)
    logits = (
        q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    )  # [B,H,N,N]
    logits = logits.masked_fill(~case.layout.valid_mask[:, None, :, None], float("-inf"))
    attn = torch.softmax(logits, dim=2) * case.layout.text_mask[:, None, None, :]
    ref = _per_head(attn.nan_to_num(0.0).sum(3), heads)
    ref = torch.where(case.layout.vision_mask, ref, torch.zeros_like(ref))
    torch.testing.assert_close(
        QueryAxisSoftmax(heads=heads).score(q, k, case.layout), ref, rtol=1e-10, atol=1e-12
    )


@pytest.mark.parametrize("heads", ["sum", "mean", "max"])
@settings(max_examples=30)
@given(case=batches())
def test_last_token_heads_against_the_last_row_of_attention(heads, case):
    q, k = _qk(case, kv_heads=4)
    valid = case.layout.valid_mask
    logits = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(
        ~valid[:, None, None, :], float("-inf")
    )
    attn = torch.softmax(logits, dim=-1)
    xi = LastTokenAttention(heads=heads).score(q, k, case.layout)
    for b in range(case.layout.batch_size):
        last = int(valid[b].nonzero().max())
        ref = _per_head(attn[b : b + 1, :, last], heads)[0]
        ref = torch.where(case.layout.vision_mask[b], ref, torch.zeros_like(ref))
        torch.testing.assert_close(xi[b], ref, rtol=1e-10, atol=1e-12)


def test_the_default_heads_are_the_old_formulas():
    lay = VisionLayout.from_segments(
        2, 12, [ImageSegment(0, 2, (2, 3)), ImageSegment(1, 1, (3, 2))]
    )
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 12, 8, generator=gen), torch.randn(2, 2, 12, 8, generator=gen)
    assert QueryAxisSoftmax().heads == "sum" and LastTokenAttention().heads == "mean"
    assert torch.equal(
        QueryAxisSoftmax().score(q, k, lay), QueryAxisSoftmax(heads="sum").score(q, k, lay)
    )
    torch.testing.assert_close(
        QueryAxisSoftmax(heads="mean").score(q, k, lay), QueryAxisSoftmax().score(q, k, lay) / 4
    )
    # last_token: bit for bit the formula before `heads` existed
    last = (lay.valid_mask.long() * torch.arange(1, 13)).argmax(dim=1)
    q_last = q.gather(2, last[:, None, None, None].expand(-1, 4, 1, 8))
    logits = (q_last @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(8)).masked_fill(
        ~lay.valid_mask[:, None, None, :], float("-inf")
    )
    old = torch.softmax(logits, dim=-1).mean(dim=1)[:, 0]
    assert torch.equal(
        LastTokenAttention().score(q, k, lay),
        torch.where(lay.vision_mask, old, torch.zeros_like(old)),
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", ["sum", "mean", "max"])
@settings(max_examples=25)
@given(case=batches())
def test_text_attention_against_full_attention_rows(causal, heads, case):
    q, k = _qk(case)
    lay = case.layout
    logits = (
        q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    )  # [B,H,N,N]
    xi = TextQueryAttention(heads=heads, causal=causal).score(q, k, lay)
    for b in range(lay.batch_size):
        total = torch.zeros(q.shape[1], lay.seq_len, dtype=torch.float64)
        for i in lay.text_mask[b].nonzero().flatten().tolist():
            seen = [
                j
                for j in range(lay.seq_len)
                if lay.valid_mask[b, j] and (not causal or lay.origin[b, j] <= lay.origin[b, i])
            ]
            total[:, seen] += torch.softmax(logits[b, :, i, seen], dim=-1)
        ref = _per_head(total.unsqueeze(0), heads)[0]
        ref = torch.where(lay.vision_mask[b], ref, torch.zeros_like(ref))
        torch.testing.assert_close(xi[b], ref, rtol=1e-10, atol=1e-12)


def test_causal_text_attention_ignores_text_before_the_image():
    lay = VisionLayout.from_segments(
        1, 9, [ImageSegment(0, 3, (2, 2))]
    )  # text 0-2, image 3-6, text 7-8
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 9, 4, generator=gen), torch.randn(1, 2, 9, 4, generator=gen)
    before = q.clone()
    before[:, :, :3] = torch.randn(1, 2, 3, 4, generator=gen)  # other queries before the image
    assert torch.equal(
        TextQueryAttention().score(q, k, lay), TextQueryAttention().score(before, k, lay)
    )
    assert not torch.equal(
        TextQueryAttention(causal=False).score(q, k, lay),
        TextQueryAttention(causal=False).score(before, k, lay),
    )


def test_heads_must_be_known():
    for cls in (QueryAxisSoftmax, LastTokenAttention, TextQueryAttention):
        with pytest.raises(ValueError, match="unknown heads"):
            cls(heads="median")


# ---------------------------------------------------------------- YAML


def test_the_new_policies_load_from_yaml_and_round_trip():
    import lightkv

    text = """
schedule: {layers: [1, 2], removal_ratios: [0.5], windows_per_side: [2, 1]}
partitioner: {name: relevance_split, params: {sources: 0.75}}
pruner: {name: relevance_budget, params: {strength: 2.0, scope: row}}
passer: {name: relevance_size_mean, params: {relevance_power: 0.5}}
relevance: {name: text_attention, params: {heads: max, causal: false}}
"""
    pipe = PipelineConfig.from_yaml_text(text).build()
    assert pipe.partitioner.sources == 0.75 and pipe.pruner.scope == "row"
    assert pipe.passer.relevance_power == 0.5 and pipe.relevance.heads == "max"
    again = PipelineConfig.from_yaml_text(lightkv.to_yaml(pipe)).build()
    assert (again.partitioner, again.pruner, again.passer, again.relevance) == (
        pipe.partitioner,
        pipe.pruner,
        pipe.passer,
        pipe.relevance,
    )
    pipe = PipelineConfig.from_yaml_text(
        "partitioner: {name: relevance_split, params: {sources: ratio}}\n"
        "relevance: {name: last_token, params: {heads: sum}}"
    ).build()
    assert pipe.partitioner.sources == "ratio" and pipe.relevance == LastTokenAttention(heads="sum")
