"""The cache mode's pure parts: `CacheStage` on random caches (merged entries are convex
combinations of their sources, keys and values with the same weights), the importance
partitioner, accumulated attention against the explicit N x N softmax, and H2O's keep rule
against a per-row loop."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightkv
from lightkv import Stage
from lightkv.adapters.modes.h2o import H2OMode
from lightkv.cache_stage import CacheStage
from lightkv.config import PipelineConfig
from lightkv.methods import (
    AccumulatedAttention,
    ImportancePartitioner,
    accumulated_attention,
    h2o_keep,
)
from lightkv.policies import (
    CacheSchedule,
    CosineDivergence,
    MessagePasser,
    SmallestDivergence,
    StageInputs,
    StageSpec,
    average_kept_fraction,
)
from lightkv.presets import get_preset_config
from lightkv.testing import check_policy
from tests.strategies import batches, ratios

H, D = 2, 3


def cache_of(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, n = case.layout.batch_size, case.layout.seq_len
    return (
        torch.randn(b, H, n, D, generator=gen, dtype=torch.float64),
        torch.randn(b, H, n, D + 1, generator=gen, dtype=torch.float64),
    )


def elastic(ratio, passer="size_mean", scope="image"):
    return Stage(
        StageSpec(0, ratio, windows_per_side=1, mode="cache"),
        partitioner=ImportancePartitioner(scope=scope),
        scorer=CosineDivergence(features="key_states"),
        pruner=SmallestDivergence(),
        passer=MessagePasser.create(passer),
    )


@settings(max_examples=60, deadline=None)
@given(
    case=batches(),
    ratio=ratios,
    passer=st.sampled_from(["size_mean", "relevance_mean"]),
    scope=st.sampled_from(["image", "row"]),
)
def test_merged_cache_entries_are_convex_combinations_of_their_sources(case, ratio, passer, scope):
    keys, values = cache_of(case)
    out = CacheStage(elastic(ratio, passer, scope))(keys, values, case.layout, case.relevance)
    res = out.result
    for b in range(case.layout.batch_size):
        for j in range(res.kept_index.shape[1]):
            src = res.provenance.sources(b, j)
            if not src:
                assert not bool(out.valid[b, j]) and bool((out.keys[b, :, j] == 0).all())
                continue
            w = (
                case.relevance[b, src]
                if passer == "relevance_mean"
                else torch.ones(len(src), dtype=torch.float64)
            )
            w = w / w.sum()
            assert (w >= 0).all() and math.isclose(float(w.sum()), 1.0)
            k_exp = (w[None, :, None] * keys[b][:, src]).sum(1)
            v_exp = (w[None, :, None] * values[b][:, src]).sum(1)
            torch.testing.assert_close(out.keys[b, :, j], k_exp, rtol=0, atol=1e-12)
            torch.testing.assert_close(out.values[b, :, j], v_exp, rtol=0, atol=1e-12)
            # a merged entry sits at its anchor's column
            assert int(out.origin[b, j]) == int(res.kept_index[b, j])


@settings(max_examples=40, deadline=None)
@given(case=batches(), ratio=ratios)
def test_anchors_are_the_most_important_and_each_source_joins_its_nearest_anchor(case, ratio):
    keys, values = cache_of(case, seed=1)
    stage = elastic(ratio)
    out = CacheStage(stage)(keys, values, case.layout, case.relevance)
    lay = case.layout
    inputs = StageInputs(lay, stage.spec, relevance=case.relevance)
    part = stage.partitioner.partition(inputs)
    k = keys.transpose(1, 2).flatten(2)
    for b in range(lay.batch_size):
        for img in torch.unique(lay.image[b][lay.vision_mask[b]]).tolist():
            members = ((lay.image[b] == img) & lay.vision_mask[b]).nonzero().flatten()
            n_w = members.numel()
            leave = min(math.floor(n_w * ratio + 1e-9), n_w - 1)
            src = members[part.is_src[b, members]]
            anchors = members[~part.is_src[b, members]]
            assert src.numel() == leave
            if leave:
                assert float(case.relevance[b, src].max()) <= float(
                    case.relevance[b, anchors].min()
                )
            owner = out.result.provenance.owner[b]
            for s in src.tolist():
                cos = torch.nn.functional.cosine_similarity(k[b, s][None], k[b, anchors], dim=-1)
                best = int(anchors[int(torch.argmax(cos))])
                assert int(owner[s]) == int(owner[best])
    # vision entries left: exactly the anchors
    assert int(out.result.layout.vision_counts().sum()) == int(
        (part.window >= 0).sum() - part.is_src.sum()
    )


@settings(max_examples=30, deadline=None)
@given(case=batches())
def test_a_cache_stage_that_removes_nothing_is_the_identity(case):
    keys, values = cache_of(case)
    out = CacheStage(elastic(0.0))(
        keys.float(), values.float(), case.layout, case.relevance.float()
    )
    assert torch.equal(out.keys, keys.float()) and torch.equal(out.values, values.float())
    assert torch.equal(out.origin, case.layout.origin)


@settings(max_examples=30, deadline=None)
@given(case=batches(max_side=5), causal=st.booleans())
def test_accumulated_attention_equals_the_explicit_softmax(case, causal):
    lay = case.layout
    b, n = lay.batch_size, lay.seq_len
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, 2 * H, n, D, generator=gen, dtype=torch.float64)
    k = torch.randn(b, H, n, D, generator=gen, dtype=torch.float64)
    got = accumulated_attention(q, k, lay.valid_mask, lay.origin, chunk=3)
    kk = k.repeat_interleave(2, dim=1)
    ref = torch.zeros(b, n, dtype=torch.float64)
    for r in range(b):
        for i in range(n):
            if not lay.valid_mask[r, i]:
                continue
            cols = [
                j for j in range(n) if lay.valid_mask[r, j] and lay.origin[r, j] <= lay.origin[r, i]
            ]
            logits = torch.einsum("hd,hjd->hj", q[r, :, i], kk[r][:, cols]) / math.sqrt(D)
            ref[r, cols] += torch.softmax(logits, dim=-1).sum(0)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    xi = AccumulatedAttention().score(q, k, lay)
    torch.testing.assert_close(xi, torch.where(lay.vision_mask, ref, torch.zeros_like(ref)))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 3), length=st.integers(1, 12))
def test_h2o_keep_equals_a_per_row_loop(seed, b, length):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (b, length), generator=gen).double()  # ties on purpose
    candidate = torch.rand(b, length, generator=gen) < 0.7
    origin = torch.arange(length).expand(b, length)
    heavy = torch.randint(0, length + 1, (b,), generator=gen)
    recent = torch.randint(0, length + 1, (b,), generator=gen)
    keep = h2o_keep(scores, candidate, origin, heavy, recent)
    for r in range(b):
        cand = [j for j in range(length) if candidate[r, j]]
        rec = sorted(cand, key=lambda j: -j)[: int(recent[r])]
        rest = [j for j in cand if j not in rec]
        hv = sorted(rest, key=lambda j: (-float(scores[r, j]), j))[: int(heavy[r])]
        expected = {j for j in range(length) if not candidate[r, j]} | set(rec) | set(hv)
        assert set(keep[r].nonzero().flatten().tolist()) == expected


def test_policies_keep_the_contract():
    check_policy(ImportancePartitioner)
    check_policy(AccumulatedAttention)
    check_policy(CacheSchedule, removal_ratio=0.5)
    check_policy(H2OMode, budget=0.3)


def test_schedules_and_presets():
    specs = CacheSchedule(removal_ratio=0.25, layers=(1, 3)).plan(4)
    assert [(s.layer, s.removal_ratio, s.mode == "cache") for s in specs] == [
        (1, 0.25, True),
        (3, 0.25, True),
    ]
    assert average_kept_fraction(specs, 4) == pytest.approx((1 + 0.75 + 1 + 0.75) / 4)
    assert len(CacheSchedule().plan(6)) == 6
    with pytest.raises(ValueError, match="only 4 layers"):
        CacheSchedule(layers=(5,)).plan(4)
    with pytest.raises(ValueError, match="registered mode name"):
        StageSpec(0, 0.5, windows_per_side=1, mode="")
    assert lightkv.load("h2o").stages(4) == [] and H2OMode(layers=(0, 2)).evict_layers(4) == [0, 2]
    heavy, recent = H2OMode(budget=0.5, recent_share=0.5).counts(torch.tensor([64, 7]))
    assert heavy.tolist() == [16, 2] and recent.tolist() == [16, 1]
    for name in ("elasticcache", "h2o"):
        cfg = get_preset_config(name)
        assert PipelineConfig.from_yaml_text(cfg.to_yaml()) == cfg
    assert lightkv.load("elasticcache").stages(4)[0].spec.mode == "cache"
    assert get_preset_config("elasticcache").average_kept_fraction(4) == 0.5
