"""A stage never changes the attention implementation: every preset keeps sdpa (what ran,
watched per call, and the configs after the session), but for the released presets' declared
eager merge layers; FlashAttention-3, paged attention and
static caches are refused with errors that say why and name the fix (FlashAttention-2 runs:
test_flash.py; FlexAttention: test_bias_routes.py); the watch itself sees eager and a
switch."""

from __future__ import annotations

import re

import pytest
import torch
from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.tasks.towers import fit_tower
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply
from lightkv.adapters.attention import (
    SDPA_WITHOUT_KERNEL,
    AttentionChanged,
    AttentionWatch,
    attention_modules,
    check_same_attention,
    configured_attention,
)
from lightkv.adapters.guards import attention_implementation
from lightkv.presets import PRESETS, get_preset

from .conftest import get_model, tiny_lightkv

TINY_TOWER_DEPTH = 1  # the tiny LLaVA's vision tower (lightkv.testing.common)
DEPTH = 8  # every preset's schedule fits (scaled from 32 layers)
_DEEP: dict = {}


def _deep_llava():
    if "m" not in _DEEP:  # LLaVA-1.5 exposes its tower: the tower-relevance presets run too
        _DEEP["m"] = TINY_MODELS["llava"].build(attn_implementation="sdpa", num_layers=DEPTH).eval()
    return _DEEP["m"]


def _pipeline(name: str):
    try:
        pipe = knob_pipeline(name, DEPTH, 0.5)[0]
    except TypeError:  # a budget schedule (lightkv-budget): the preset as it is
        pipe = get_preset(name)
    return fit_tower(pipe, TINY_TOWER_DEPTH)  # VScan's local scan reads a shallow tower layer


def _watched_prefill(pipe, model, batch, **options):
    before = configured_attention(model)
    with apply(pipe, model, **options) as session, AttentionWatch(model) as watch:
        model(**batch)
    return before, watch, session


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_runs_the_attention_the_model_was_loaded_with(preset):
    model = _deep_llava()
    fam = TINY_MODELS["llava"]
    before, watch, session = _watched_prefill(
        _pipeline(preset), model, fam.collate([fam.row(model, seed=1)])
    )
    assert session.last_prefill is not None
    eager = len(session._ctx.released.eager_layers)
    if preset.startswith("lightkv-paper-released"):
        # the one declared switch: the released code's merge layers run eager (eager_merge_layers)
        assert eager == len([s for s in session._ctx.stages if s.spec.removal_ratio > 0]) > 0
    assert eager == 0 or preset.startswith("lightkv-paper-released")
    want = {"sdpa": DEPTH - eager, "eager": eager} if eager else {"sdpa": DEPTH}
    assert dict(watch.ran) == want and watch.sdpa_kernels == DEPTH - eager
    assert configured_attention(model) == before and set(before.values()) == {"sdpa"}
    assert all("forward" not in m.__dict__ for m in attention_modules(model))  # the watch is gone


@pytest.mark.parametrize("mode", ["hidden", "pre_llm", "cache", "h2o"])
def test_every_mode_keeps_sdpa_in_every_family(family, mode):
    model = get_model(family)
    fam = TINY_MODELS[family]
    pipe = (
        tiny_lightkv()
        if mode == "hidden"
        else knob_pipeline(
            {"pre_llm": "divprune", "cache": "elasticcache", "h2o": "h2o"}[mode], 4, 0.5
        )[0]
    )
    try:
        before, watch, _ = _watched_prefill(
            pipe, model, fam.collate(fam.examples(model)), **fam.adapter_options
        )
    except NotImplementedError:  # a family that refuses the mode (Qwen3-VL's DeepStack and pre-LLM)
        return
    layers = len(attention_modules(model))
    assert dict(watch.ran) == {"sdpa": layers}
    assert configured_attention(model) == before


def test_the_watch_sees_eager_attention():
    model = get_model("llava", attn="eager")
    fam = TINY_MODELS["llava"]
    _, watch, _ = _watched_prefill(tiny_lightkv(), model, fam.collate(fam.examples(model)))
    assert dict(watch.ran) == {"eager": 4} and watch.sdpa_kernels == 0


def test_a_switch_to_eager_inside_a_prefill_is_caught(monkeypatch):
    """A (misbehaving) hook that switches the shared text config to eager at layer 2: the
    watch records both and the check names the preset."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    cfg = attention_modules(model)[0].config
    layer = model.model.language_model.layers[2]
    handle = layer.register_forward_pre_hook(
        lambda *a: setattr(cfg, "_attn_implementation", "eager")
    )
    try:
        _, watch, _ = _watched_prefill(tiny_lightkv(), model, fam.collate(fam.examples(model)))
    finally:
        handle.remove()
        cfg._attn_implementation = "sdpa"
    assert dict(watch.ran) == {"sdpa": 2, "eager": 2}
    with pytest.raises(
        AttentionChanged,
        match="preset 'lightkv' ran .*'eager', 'sdpa'.* but uncompressed ran.*"
        "eager_merge_layers.*turn it off",
    ):
        check_same_attention(
            {"uncompressed": ["sdpa"], "lightkv": watch.implementations}, "uncompressed"
        )
    check_same_attention({"uncompressed": ["sdpa"], "lightkv": ["sdpa"]}, "uncompressed")


def test_an_sdpa_call_without_the_kernel_is_named():
    """A module dispatched to sdpa that computes attention another way is not counted as sdpa."""
    model = get_model("llava")
    mods = attention_modules(model)
    calls = []

    class Fake(torch.nn.Module):  # a module that claims sdpa and runs a plain matmul
        config = mods[0].config

        def forward(self, x):
            calls.append(1)
            return x @ x.T

    fake = Fake()
    with AttentionWatch(model, [fake]) as watch:
        fake(torch.ones(2, 2))
    assert calls and dict(watch.ran) == {SDPA_WITHOUT_KERNEL: 1}


@pytest.mark.parametrize("impl", ["flash_attention_3", "paged|sdpa"])
def test_other_flash_kernels_and_paged_attention_are_refused_at_apply(monkeypatch, impl):
    """lightkv's 2-D padding masks are checked against FlashAttention-2's contract only, and
    paged attention takes none of its masks: ``apply`` refuses (a tiny model's config names
    it; nothing runs). FlashAttention-2 (test_flash.py) and FlexAttention
    (test_bias_routes.py) run."""
    model = get_model("llava")
    monkeypatch.setattr(model.model.language_model.config, "_attn_implementation", impl)
    with pytest.raises(ValueError, match=f"uses '{re.escape(impl)}'.*attn_implementation='sdpa'"):
        apply(tiny_lightkv(), model)
    with pytest.raises(
        ValueError, match="FlashAttention-2's contract only" if "flash" in impl else "takes neither"
    ):
        attention_implementation(model.model.language_model.config)
    assert attention_implementation(type("C", (), {"_attn_implementation": "sdpa"})) == "sdpa"


@pytest.mark.parametrize("preset", ["lightkv", "divprune", "elasticcache", "h2o"])
def test_a_static_cache_is_refused_inside_a_session_and_works_after_it(preset):
    """``cache_implementation="static"`` (what CUDA-graph decoding needs) cannot hold the
    per-layer lengths and holes: refused at the prefill, naming why; once the session is
    closed the same model decodes with a static cache as with the dynamic one."""
    model = _deep_llava()
    fam = TINY_MODELS["llava"]
    batch = fam.collate([fam.row(model, seed=2)])  # one row, no padding
    gen = dict(max_new_tokens=4, do_sample=False)
    with apply(_pipeline(preset), model):
        compressed = model.generate(**batch, **gen)
        with pytest.raises(
            TypeError,
            match="default dynamic cache only.*StaticLayer.*one decoding mask.*"
            "CUDA graphs.*drop cache_implementation=",
        ):
            model.generate(**batch, **gen, cache_implementation="static")
    assert compressed.shape[1] == batch["input_ids"].shape[1] + 4
    assert torch.equal(
        model.generate(**batch, **gen, cache_implementation="static"),
        model.generate(**batch, **gen),
    )
