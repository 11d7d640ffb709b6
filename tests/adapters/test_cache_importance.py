"""Cache-level importance (ElasticCache, H2O) read from the layer's own projections as the
layer runs, against the path it replaced: the layer's input projected a second time and the
accumulated attention of every query chunk over every key column (`reference_accumulated`,
the function as it was). On every family's tiny model, a padded batch: the same kept
entries in every compressed layer, the same cache and the same generated tokens, the same
importance within a few ulps (the function now sums in blocks and in float64, the reference
in float32 over whole chunks); and the tap really scored every layer (no fallback).

The pure function is also checked against the reference on random layouts with holes
anywhere and origins in any order (what `causal_chunks` must not get wrong), against an
independent dense oracle (the whole ``N x N`` masked softmax, float64) with every blocking
of heads, and on exact ties (they stay exact, so the keep rules' tie-breaks decide).
"""

from __future__ import annotations

import math
import time
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkv_lab.bench.efficiency.measure import OverheadProbe

from lightkv.adapters import apply
from lightkv.adapters.modes import h2o as h2o_mode
from lightkv.methods import cache_policies
from lightkv.policies.relevance import _accumulator, _match_heads
from lightkv.testing import TINY_MODELS

from .conftest import get_model
from .test_cache_mode import METHODS

GEN = {"max_new_tokens": 4, "do_sample": False, "return_dict_in_generate": True}


def reference_accumulated(queries, keys, valid, origin, scale=None, chunk=256):
    """`accumulated_attention` before the tap (kept here as the reference): every chunk of
    query rows against every key column, a full masked softmax, NaN rows zeroed."""
    b, h, n, d = queries.shape
    acc = _accumulator(queries)
    k = _match_heads(keys, h).to(acc)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.zeros(b, n, dtype=acc, device=queries.device)
    for start in range(0, n, chunk):
        q = queries[:, :, start : start + chunk].to(acc)
        logits = torch.matmul(q, k.transpose(-1, -2)) * scale
        allowed = (
            origin.unsqueeze(1) <= origin[:, start : start + chunk].unsqueeze(2)
        ) & valid.unsqueeze(1)
        allowed &= valid[:, start : start + chunk].unsqueeze(2)
        logits = logits.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        out += torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=(1, 2))
    return out


def _cache_mode(session):
    return next(m for m in session.modes if m.name in ("cache", "h2o"))


def _run(model, fam, batch, pipe, *, old: bool, monkeypatch):
    """Prefill + greedy decoding; per compressed layer the importance, whether the tap
    scored it, and the kept entries (valid, origin, keys) right after the prefill."""
    with monkeypatch.context() as m:
        if old:
            m.setattr(cache_policies, "accumulated_attention", reference_accumulated)
            m.setattr(h2o_mode, "accumulated_attention", reference_accumulated)
        with apply(pipe, model, reuse_projections=not old, **fam.adapter_options) as session:
            mode = _cache_mode(session)
            log: dict[int, dict] = {}
            importance, rewrite = mode.importance, mode.rewrite

            def spy_importance(call, raw=None):
                log.setdefault(call.layer, {})["tapped"] = raw is not None
                return importance(call, raw)

            def spy_rewrite(call, layer, xi):
                kind = rewrite(call, layer, xi)
                log[call.layer].update(
                    xi=xi.clone(),
                    valid=layer.valid.clone(),
                    origin=layer.origin.clone(),
                    keys=layer.keys.clone(),
                    values=layer.values.clone(),
                )
                return kind

            m.setattr(mode, "importance", spy_importance)
            m.setattr(mode, "rewrite", spy_rewrite)
            out = model.generate(**batch, **GEN)
    return log, out.sequences


@pytest.mark.parametrize("method", sorted(METHODS))
def test_tapped_importance_keeps_what_the_second_projection_kept(family, method, monkeypatch):
    model = get_model(family)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))  # left-padded: holes in the causal mask
    old, old_tokens = _run(model, fam, batch, METHODS[method](), old=True, monkeypatch=monkeypatch)
    new, new_tokens = _run(model, fam, batch, METHODS[method](), old=False, monkeypatch=monkeypatch)
    assert sorted(old) == sorted(new) and old
    for layer in old:
        assert not old[layer]["tapped"] and new[layer]["tapped"], layer
        # the same entries kept, merged from the same sources with the same weights
        for what in ("valid", "origin", "keys", "values"):
            assert torch.equal(old[layer][what], new[layer][what]), (layer, what)
        # a few ulps: the two sum the same softmax rows in different orders
        torch.testing.assert_close(old[layer]["xi"], new[layer]["xi"], rtol=1e-6, atol=1e-7)
    assert torch.equal(old_tokens, new_tokens)


def test_tapped_importance_on_eager_attention(monkeypatch):
    model = get_model("llava", "eager")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    for method in ("elastic", "h2o-all"):
        old, old_tokens = _run(
            model, fam, batch, METHODS[method](), old=True, monkeypatch=monkeypatch
        )
        new, new_tokens = _run(
            model, fam, batch, METHODS[method](), old=False, monkeypatch=monkeypatch
        )
        for layer in old:
            assert new[layer]["tapped"]
            assert torch.equal(old[layer]["origin"], new[layer]["origin"])
            torch.testing.assert_close(old[layer]["xi"], new[layer]["xi"], rtol=1e-6, atol=1e-7)
        assert torch.equal(old_tokens, new_tokens)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    n=st.integers(1, 300),
    chunk=st.sampled_from([1, 5, 64, 256]),
    holes=st.sampled_from(["none", "left", "right", "anywhere"]),
    shuffled=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_accumulated_attention_equals_the_full_chunked_softmax(
    seed, b, n, chunk, holes, shuffled, dtype
):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 4, n, 8, generator=gen, dtype=dtype)
    k = torch.randn(b, 2, n, 8, generator=gen, dtype=dtype)
    valid = torch.ones(b, n, dtype=torch.bool)
    cut = torch.randint(0, n, (b,), generator=gen)
    for r in range(b):
        if holes == "left":
            valid[r, : cut[r]] = False
        elif holes == "right":
            valid[r, n - cut[r] :] = False
        elif holes == "anywhere":
            valid[r] = torch.rand(n, generator=gen) < 0.7
    origin = torch.stack(
        [torch.randperm(n, generator=gen) if shuffled else torch.arange(n) for _ in range(b)]
    )
    origin = origin.masked_fill(~valid, -1)
    got = cache_policies.accumulated_attention(q, k, valid, origin, 0.3, chunk=chunk)
    # the same softmax rows summed in another order (and a BLAS may order a shorter
    # product's sums differently, seen in float64), hence a few ulps
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(
        got, reference_accumulated(q, k, valid, origin, 0.3, chunk=chunk), rtol=tol, atol=tol
    )


def dense_oracle(queries, keys, valid, origin, scale):
    """The definition, nothing shared with the function: per batch row the ``N x N`` allowed
    matrix, the masked softmax of every head in float64, fully masked rows 0, summed."""
    b, h, n, _ = queries.shape
    k = keys.double().repeat_interleave(h // keys.shape[1], dim=1)
    out = torch.zeros(b, n, dtype=torch.float64)
    for r in range(b):
        allowed = (
            (origin[r][None, :] <= origin[r][:, None]) & valid[r][None, :] & valid[r][:, None]
        )  # [i, j]
        logits = (queries[r].double() @ k[r].transpose(-1, -2)) * scale  # [H, N, N]
        attn = torch.softmax(logits.masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
        out[r] = attn.sum(dim=(0, 1))
    return out


def _layout(gen, b, n, holes):
    valid = torch.ones(b, n, dtype=torch.bool)
    for r in range(b):
        cut = int(torch.randint(0, n, (1,), generator=gen))
        if holes == "left":  # left padding, as a padded batch
            valid[r, :cut] = False
        elif holes == "anywhere":
            valid[r] = torch.rand(n, generator=gen) < 0.7
    return valid


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    n=st.integers(1, 200),
    heads=st.sampled_from([(4, 4), (4, 2), (6, 1)]),
    chunk=st.sampled_from([1, 7, 64, 256]),
    block=st.sampled_from([1, 300, 1 << 20]),
    holes=st.sampled_from(["none", "left", "anywhere"]),
    shuffled=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_accumulated_attention_equals_the_dense_oracle(
    seed, b, n, heads, chunk, block, holes, shuffled, dtype
):
    gen = torch.Generator().manual_seed(seed)
    h, h_kv = heads
    q = torch.randn(b, h, n, 16, generator=gen, dtype=dtype) * 2  # logits up to ~+-20: peaked rows
    k = torch.randn(b, h_kv, n, 16, generator=gen, dtype=dtype)
    valid = _layout(gen, b, n, holes)
    origin = torch.stack(
        [torch.randperm(n, generator=gen) if shuffled else torch.arange(n) for _ in range(b)]
    )
    origin = origin.masked_fill(~valid, -1)
    with mock.patch.object(
        cache_policies, "_BLOCK", block
    ):  # one head per block, some heads, all heads
        got = cache_policies.accumulated_attention(q, k, valid, origin, 0.25, chunk=chunk)
    want = dense_oracle(q, k, valid, origin, 0.25)
    assert got.dtype == dtype
    tol = (1e-12, 1e-12) if dtype == torch.float64 else (2e-6, 1e-6)
    torch.testing.assert_close(got.double(), want, rtol=tol[0], atol=tol[1])
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))  # a hole receives nothing


@pytest.mark.parametrize("block", [1, 1 << 20])
def test_exact_ties_stay_exact_and_the_keep_rule_breaks_them_by_position(block):
    """Tokens with equal keys and equal origins receive exactly the same attention from every
    query (uniform rows): their scores must come out bit-identical, whatever the chunking,
    blocking and padding, so that H2O keeps the earliest of them, as its rule says, and
    never whichever the rounding favoured."""
    b, h, n = 2, 4, 600
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, n, 32, generator=gen)
    k = torch.randn(1, 1, 1, 32, generator=gen).expand(b, 2, n, 32)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :37] = False  # a left-padded row
    origin = torch.zeros(b, n, dtype=torch.long).masked_fill(
        ~valid, -1
    )  # every valid token sees every other
    with mock.patch.object(cache_policies, "_BLOCK", block):
        xi = cache_policies.accumulated_attention(q, k, valid, origin, chunk=256)
    for r in range(b):
        row = xi[r][valid[r]]
        assert torch.equal(row, row[:1].expand_as(row)), r
        torch.testing.assert_close(
            row[0].item(), float(h), rtol=1e-6, atol=0
        )  # each of h heads spreads 1 per query
    heavy, recent = torch.tensor([5, 5]), torch.tensor([0, 0])
    keep = (
        cache_policies.h2o_keep(xi.double(), valid, origin, heavy, recent) & valid
    )  # as H2OMode._evict
    for r in range(b):
        first = int((~valid[r]).sum())
        assert keep[r].nonzero().flatten().tolist() == list(range(first, first + 5))


@pytest.mark.parametrize("method", ["elastic", "h2o-all"])
def test_the_overhead_probe_times_the_cache_modes_scoring_and_rewrite(method, monkeypatch):
    """The efficiency benchmark's overhead column: the cache modes score inside the layer
    (their projection taps) and merge or evict after it; both are the compression's own
    time and must be in the probe's totals (each made to take 30 ms here)."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    pause = 0.03
    with apply(METHODS[method](), model, **fam.adapter_options) as session:
        mode = _cache_mode(session)
        importance, rewrite = mode.importance, mode.rewrite
        tapped = []

        def slow_importance(call, raw=None):
            tapped.append(raw is not None)
            time.sleep(pause)
            return importance(call, raw)

        def slow_rewrite(call, layer, xi):
            time.sleep(pause)
            return rewrite(call, layer, xi)

        monkeypatch.setattr(mode, "importance", slow_importance)
        monkeypatch.setattr(mode, "rewrite", slow_rewrite)
        probe = OverheadProbe(session, lambda: None)
        with torch.no_grad():
            model.generate(**batch, max_new_tokens=1, do_sample=False)
        probe.close()
    layers = len(mode.layers)
    assert tapped == [True] * layers  # scored inside the attention, by the taps
    assert probe.totals["relevance"] >= pause * layers
    assert probe.totals["stage"] >= pause * layers
    assert probe.totals["bookkeeping"] < pause  # neither counted twice nor elsewhere


@pytest.mark.parametrize("n, chunk", [(600, 256), (300, 64), (70, 7)])
def test_the_flops_count_is_the_products_computed(n, chunk):
    """`accumulated_attention_flops` counts the ``q . k`` products the function really
    computes (read off its matmuls): the causal half and the chunks' diagonal blocks, not
    ``N x N``."""
    b, h, d = 2, 4, 8
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(b, h, n, d, generator=gen), torch.randn(b, 2, n, d, generator=gen)
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :5] = False
    origin = torch.arange(n).expand(b, n).masked_fill(~valid, -1)
    done, matmul = [], torch.matmul

    def counting(x, y, **kw):
        done.append(2.0 * x.shape[-3] * x.shape[-2] * x.shape[-1] * y.shape[-1])
        return matmul(x, y, **kw)

    with mock.patch.object(torch, "matmul", counting):
        cache_policies.accumulated_attention(q, k, valid, origin, chunk=chunk)
    flops = cache_policies.accumulated_attention_flops(valid, origin, h, d, chunk)
    assert flops == sum(done)
    dense = 2.0 * b * h * d * n * n
    assert (
        0.5 * dense < flops <= min(1.0, 0.5 + (chunk + 64) / n) * dense
    )  # rows of at least 64 columns


@pytest.mark.parametrize("method", ["elastic", "h2o-all"])
def test_the_session_report_counts_the_causal_products(method, monkeypatch):
    """ElasticCache and H2O read the layer's own projections, so the report's relevance
    FLOPs are the importance products alone: per cache layer what the function computes."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    with apply(METHODS[method](), model, **fam.adapter_options) as session:
        mode = _cache_mode(session)
        model.generate(**batch, max_new_tokens=1, do_sample=False)
        layout = session.last_prefill.layout
        want = sum(
            cache_policies.accumulated_attention_flops(
                layout.valid_mask,
                layout.origin,
                mode.ctx.probes[i].heads,
                mode.ctx.probes[i].head_dim,
            )
            for i in mode.layers
        )
        report = session.report()
    # (a prompt of one chunk, as here, computes every column: the causal half is checked above)
    assert report.relevance_flops == pytest.approx(want, rel=1e-12) and want > 0
