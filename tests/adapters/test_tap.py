"""The projection tap: relevance and stage keys read from a scheduled layer's own q / k
projections equal those from projecting the layer's input a second time, in every family,
and a tap that sees nothing falls back to projecting."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.adapters import apply
from lightkv.policies import CosineDivergence, ExplicitSchedule

from .conftest import get_model, tiny_lightkv


def _tome_keys():
    """ToMe with ToMe's own key-space similarity (the preset uses hidden states)."""
    pipe = lightkv.load("tome").with_scheduler(
        ExplicitSchedule(layers=(1, 2), windows_per_side=(1, 1), removal_ratios=(0.5,))
    )
    return dataclasses.replace(pipe, scorer=CosineDivergence(features="key_states"))


def _run(model, fam, batch, pipe, **options):
    with apply(pipe, model, record=True, **fam.adapter_options, **options) as session:
        out = model(**batch)
    return session, out.logits


def test_tapped_relevance_equals_projected(family):
    _check_tap(family, "lightkv")


@pytest.mark.parametrize(
    "name", ["llava", "fuyu", "gemma3"]
)  # separate, fused and normed q/k projections
def test_tapped_keys_equal_projected(name):
    _check_tap(name, "tome_keys")


def _check_tap(family, preset):
    """Every stage's ξ (LightKV: all queries x text keys) and keys (ToMe on keys) from the tap
    equal the second projection's, and so do the stage results and the logits."""
    fam = TINY_MODELS[family]
    model = get_model(family)
    batch = fam.collate(fam.examples(model))
    pipe = tiny_lightkv() if preset == "lightkv" else _tome_keys()
    tapped, logits_tapped = _run(model, fam, batch, pipe)
    projected, logits_projected = _run(model, fam, batch, pipe, reuse_projections=False)
    assert tapped.records and all(r.tapped for r in tapped.records)
    assert not any(r.tapped for r in projected.records)
    for a, b in zip(tapped.records, projected.records, strict=True):
        torch.testing.assert_close(a.relevance, b.relevance, rtol=1e-5, atol=1e-6)
        assert (b.key_states is not None) == (preset == "tome_keys")
        if b.key_states is not None:
            torch.testing.assert_close(a.key_states, b.key_states, rtol=1e-5, atol=1e-6)
        assert torch.equal(a.result.layout.origin, b.result.layout.origin)
    torch.testing.assert_close(logits_tapped, logits_projected, rtol=1e-4, atol=1e-5)
    # the tap's relevance and keys cost no projection FLOPs: only LightKV's N x T scores
    assert tapped.report().relevance_flops < projected.report().relevance_flops
    if preset == "tome_keys":
        assert tapped.report().relevance_flops == 0.0


def test_tap_that_sees_no_projection_falls_back(monkeypatch):
    """An attention that never calls the modules the probe names (here: the tap hooks a
    module nobody calls) leaves the tap empty; the session projects the input itself and
    the result is exactly the untapped one."""
    fam = TINY_MODELS["llava"]
    model = get_model("llava")
    batch = fam.collate(fam.examples(model))
    projected, logits_projected = _run(model, fam, batch, tiny_lightkv(), reuse_projections=False)
    session = apply(tiny_lightkv(), model, record=True)
    stray = torch.nn.Linear(2, 2)
    for tap in session.taps.values():
        monkeypatch.setattr(
            tap, "install", lambda tap=tap: [stray.register_forward_hook(tap._hook("q"))]
        )
    with session:
        out = model(**batch)
    assert session.records and not any(r.tapped for r in session.records)
    for a, b in zip(session.records, projected.records, strict=True):
        assert torch.equal(a.relevance, b.relevance)
    assert torch.equal(out.logits, logits_projected)


def test_tap_is_disarmed_by_a_decode_step():
    """Generation after a tapped prefill: decode steps never arm the tap, and the tokens
    equal those of the untapped session."""
    fam = TINY_MODELS["qwen2_5_vl"]
    model = get_model("qwen2_5_vl")
    batch = fam.collate(fam.examples(model))
    gen = {"max_new_tokens": 4, "do_sample": False}
    with apply(tiny_lightkv(), model) as session:
        a = model.generate(**batch, **gen)
        assert all(not t._armed for t in session.taps.values())
    with apply(tiny_lightkv(), model, reuse_projections=False):
        b = model.generate(**batch, **gen)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [1, 2])
def test_rotate_is_the_rotate_half_formula_bit_for_bit(dtype, head_dim):
    """The probes' two-pass rotary embedding equals ``x cos + cat(-x2, x1) sin`` exactly,
    in either head layout."""
    from lightkv.adapters.probes import rotate

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, generator=g).to(dtype)  # [B, H, M, d] or [B, M, H, d]
    m = x.shape[2] if head_dim == 1 else x.shape[1]
    cos, sin = (torch.randn(2, m, 8, generator=g).to(dtype) for _ in range(2))
    c, s = cos.unsqueeze(head_dim), sin.unsqueeze(head_dim)
    want = x * c + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * s
    assert torch.equal(rotate(x, cos, sin, head_dim=head_dim), want)
