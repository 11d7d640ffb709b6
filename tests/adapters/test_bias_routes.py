"""Proportional attention on kernels without a mask argument (issue 49): the bias channel
(``Q' = [Q, 1]``, ``K' = [K, log(s) / scale]``, ``V' = [V, 0]``; FlashAttention-2, sdpa) and
FlexAttention's ``score_mod``, each against the mask route (``log(size)`` on the additive
mask, itself checked against duplicated keys in ``test_proportional.py``).

On this CPU the channel runs through sdpa without a 4-D bias (``proportional_route=
"channel"``) and through `flash_standin.FlashStandIn`, a pure-torch kernel with
FlashAttention-2's contract (2-D padding masks only), under ``flash_attention_2``; the flex
route runs PyTorch's unfused FlexAttention. The oracle is the same session on the mask
route: prefill logits at every real column (with and without a cache) and 6 greedy
decoding steps agree to 1e-5 in float32 and 1e-12 in float64, tokens identical, on LLaVA
(1-D RoPE) and Qwen2.5-VL (3-D M-RoPE), a left-padded batch of two rows with unequal
images. While no token stands for more than one, no route expands anything: the outputs
are the unbiased session's bit for bit (the kernels with one more zero channel are not:
sdpa picks another CPU kernel for ``d + 1``, so the channel is added only where a layer
holds merged keys).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.adapters import apply
from lightkv.adapters.attention import AttentionWatch
from lightkv.adapters.bias import DISPATCH_KEY, BiasView, choose_route, expand_keys
from lightkv.adapters.cache import MaskedCacheLayer
from lightkv.policies import CacheSchedule, ExplicitSchedule
from lightkv.presets import get_preset

from .conftest import get_model, identity_pipeline, tiny_lightkv
from .flash_standin import NAME, FlashStandIn
from .test_flash import flash_attention

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

STEPS = 6
GEN = dict(
    max_new_tokens=STEPS,
    min_new_tokens=STEPS,
    do_sample=False,
    output_logits=True,
    return_dict_in_generate=True,
)
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
FAMILIES = ["llava", "qwen2_5_vl"]


def prop(pipe, on: bool = True):
    return dataclasses.replace(pipe, proportional_attention=on)


def cover():
    return get_preset("lightkv-cover")  # before the LLM: every layer holds merged keys


def in_prefill():
    return prop(tiny_lightkv())  # merges after layers 1 and 2: layers 0 and 1 hold none


def cache_merge():
    return prop(
        lightkv.load("elasticcache").with_scheduler(
            CacheSchedule(removal_ratio=0.5, layers=(0, 1, 3))
        )
    )


def drop_only():
    """Drops half of each window's vision tokens, merges none: every size stays 1."""
    return prop(
        lightkv.load("fastv").with_scheduler(
            ExplicitSchedule(layers=(1, 2), windows_per_side=(2, 1), removal_ratios=(0.5,))
        )
    )


def _batch(family: str, model) -> dict:
    fam = TINY_MODELS[family]
    return fam.collate(fam.examples(model)[:2])  # one image, two images: left padding


def _run(model, family, pipe, batch, route="auto", watch=False):
    """``(prefill logits [R, V], no-cache logits [R, V], generate output, cache, watch)``
    inside one session; R: the real columns of the compressed sequence."""
    fam = TINY_MODELS[family]
    with apply(pipe, model, proportional_route=route, **fam.adapter_options) as session:
        with AttentionWatch(model) as seen:
            out = model(**batch, use_cache=True)
        nocache = model(**batch, use_cache=False).logits
        layout = session.last_prefill.final_layout
        real = (
            layout.valid_mask
            if layout is not None and layout.seq_len == out.logits.shape[1]
            else batch["attention_mask"].bool()
        )
        gen = model.generate(**batch, **GEN)
    return out.logits[real], nocache[real], gen, out.cache, (seen if watch else None)


def _assert_equal_to(ref, got, tol: float) -> None:
    for a, b in zip(ref[:2], got[:2]):
        assert (a - b).abs().max().item() <= tol
    assert torch.equal(got[2].sequences, ref[2].sequences)
    assert len(got[2].logits) == STEPS
    for a, b in zip(got[2].logits, ref[2].logits):
        assert (a - b).abs().max().item() <= tol


def _head_dim(model) -> int:
    return model.model.language_model.layers[0].self_attn.head_dim


def _merged_layers(cache) -> list[int]:
    return [
        i
        for i, layer in enumerate(cache.layers)
        if isinstance(layer, MaskedCacheLayer) and layer.sizes is not None
    ]


_REF: dict = {}


def _reference(family, dtype, make):
    """The mask route's run (cached per family, dtype and pipeline)."""
    key = (family, dtype, make.__name__)
    if key not in _REF:
        model = get_model(family, dtype=dtype)
        _REF[key] = _run(model, family, make(), _batch(family, model), "mask")
    return _REF[key]


# ---------------------------------------------------------------------------- equal to the mask
@pytest.mark.parametrize("route", ["channel", "flex"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_routes_equal_the_mask_route(family, dtype, route):
    model = get_model(family, dtype=dtype)
    ref = _reference(family, dtype, cover)
    got = _run(model, family, cover(), _batch(family, model), route, watch=True)
    _assert_equal_to(ref, got, TOL[dtype])
    cache, watch = got[3], got[4]
    merged = _merged_layers(cache)
    assert merged == list(range(len(cache.layers)))  # the pre-LLM merge: every layer
    d = _head_dim(model)
    for i in merged:
        layer = cache.layers[i]
        if route == "channel":  # the cache holds K' and V' for decoding
            assert layer.keys.shape[-1] == layer.values.shape[-1] == d + 1
            assert layer.channel == pytest.approx(d**0.5)
            assert torch.equal(layer.values[..., -1], torch.zeros_like(layer.values[..., -1]))
            logs = layer.sizes.clamp_min(1).float().log().to(dtype)
            assert torch.equal(
                layer.keys[..., -1], (logs * layer.channel)[:, None].expand_as(layer.keys[..., -1])
            )
        else:
            assert layer.keys.shape[-1] == d and layer.channel is None
    # the kernel that ran: sdpa on the channel, FlexAttention on every biased layer
    want = {"sdpa": len(cache.layers)} if route == "channel" else {"flex_attention": len(merged)}
    assert dict(watch.ran) == want


def test_the_bias_is_not_vacuous():
    """The mask route the others are held to moves the logits: equality means something."""
    model = get_model("llava", dtype=torch.float64)
    batch = _batch("llava", model)
    off = _run(model, "llava", prop(cover(), False), batch, "mask")
    ref = _reference("llava", torch.float64, cover)
    assert (off[0] - ref[0]).abs().max().item() > 1e-3


@pytest.mark.parametrize("route", ["channel", "flex"])
@pytest.mark.parametrize("make", [in_prefill, cache_merge], ids=["in-prefill", "cache"])
def test_other_modes_equal_the_mask_route(make, route):
    """Merges after a layer (layers before it hold no merged key, the routes leave them
    alone) and in the cache (its entries replaced with K', V' after the layer ran)."""
    model = get_model("llava", dtype=torch.float64)
    ref = _reference("llava", torch.float64, make)
    got = _run(model, "llava", make(), _batch("llava", model), route)
    _assert_equal_to(ref, got, TOL[torch.float64])
    merged = _merged_layers(got[3])
    assert merged == ([2, 3] if make is in_prefill else [0, 1, 3])
    for i, layer in enumerate(got[3].layers):
        expanded = layer.keys.shape[-1] == _head_dim(model) + 1
        assert expanded == (route == "channel" and i in merged)


# ---------------------------------------------------------------------------- sizes of 1
@pytest.mark.parametrize("route", ["channel", "flex"])
@pytest.mark.parametrize("family", FAMILIES)
def test_with_every_size_1_the_routes_are_the_unbiased_path_bit_for_bit(family, route):
    model = get_model(family)
    batch = _batch(family, model)
    for make in (drop_only, identity_pipeline):
        off = _run(model, family, prop(make(), False), batch)
        on = _run(model, family, prop(make()), batch, route, watch=True)
        assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
        assert torch.equal(on[2].sequences, off[2].sequences)
        assert all(torch.equal(a, b) for a, b in zip(on[2].logits, off[2].logits))
        assert set(on[4].ran) == {"sdpa"}  # nothing routed
        d = _head_dim(model)
        assert all(layer.keys.shape[-1] == d for layer in on[3].layers)


# ---------------------------------------------------------------------------- FlashAttention-2
@pytest.fixture
def flash():
    standin = FlashStandIn()
    with standin.registered():
        yield standin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lightkv_cover_under_flash_attention_2_equals_the_mask_route(flash, family, dtype):
    """The preset is no longer refused under FlashAttention-2: it takes the channel route
    (2-D padding masks only, the cache holding K' and V'), and equals its sdpa mask run."""
    model = get_model(family, dtype=dtype)
    ref = _reference(family, dtype, cover)
    with flash_attention(model):
        got = _run(model, family, cover(), _batch(family, model), watch=True)
    _assert_equal_to(ref, got, TOL[dtype])
    assert flash.counts["masks_4d"] == 0 and flash.counts["varlen"] > 0
    assert dict(got[4].ran) == {NAME: len(got[3].layers)}
    d = _head_dim(model)
    assert all(layer.keys.shape[-1] == d + 1 for layer in got[3].layers)


def test_beam_search_reorders_the_bias_channel_with_the_cache(flash):
    """Beams reorder, repeat and select the cache's rows, K' and V' with them: the beams and
    scores of the sdpa mask route."""
    model = get_model("llava")
    batch = _batch("llava", model)
    beams = dict(
        max_new_tokens=4,
        num_beams=3,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with apply(cover(), model):
        ref = model.generate(**batch, **beams)
    with flash_attention(model), apply(cover(), model):
        out = model.generate(**batch, **beams)
    assert torch.equal(out.sequences, ref.sequences)
    assert (out.sequences_scores - ref.sequences_scores).abs().max().item() <= 1e-5
    assert flash.counts["masks_4d"] == 0


def test_a_session_under_the_real_flash_name_is_not_refused_for_the_bias():
    """Without the stand-in (this CPU has no FlashAttention-2 kernel) the session starts:
    only running the model would need the kernel, as for the model without lightkv."""
    model = TINY_MODELS["llava"].build(attn_implementation="sdpa")
    model.config._attn_implementation = NAME
    with apply(cover(), model) as session:
        assert session._ctx.proportional.route(NAME) == "channel"


# ---------------------------------------------------------------------------- the pieces
def test_route_choice_and_its_refusals():
    assert [choose_route("auto", i) for i in ("eager", "sdpa", NAME, "flex_attention")] == [
        "mask",
        "mask",
        "channel",
        "flex",
    ]
    with pytest.raises(ValueError, match="FlashAttention-2 does not take"):
        choose_route("mask", NAME)
    for route in ("mask", "channel"):
        with pytest.raises(ValueError, match=f"'{route}' under flex_attention.*use 'flex'"):
            choose_route(route, "flex_attention")
    assert choose_route("channel", "eager") == "channel" and choose_route("flex", NAME) == "flex"
    with pytest.raises(ValueError, match="unknown proportional_route 'bias'"):
        apply(cover(), get_model("llava"), proportional_route="bias")


def test_the_extra_logit_is_log_size():
    """``Q' . K' * scale`` is ``Q . K * scale + log(s)`` (float64, a scale that is not a
    power of two), one bias column per KV head."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 12, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 7, 12, generator=g, dtype=torch.float64)
    sizes = torch.randint(0, 9, (2, 7), generator=g)
    logs = sizes.clamp_min(1).double().log()
    scale = 12**-0.5
    k2 = expand_keys(k, logs, 1 / scale)
    q2 = torch.nn.functional.pad(q, (0, 1), value=1.0)
    rep = lambda t: t.repeat_interleave(2, dim=1)  # noqa: E731
    got = q2 @ rep(k2).transpose(-1, -2) * scale
    want = q @ rep(k).transpose(-1, -2) * scale + logs[:, None, None, :]
    assert (got - want).abs().max().item() <= 1e-13
    assert torch.equal(k2[:, 0, :, -1], k2[:, 1, :, -1])


def test_the_view_is_per_call_and_the_key_refuses_outside_a_session():
    model = get_model("llava")
    batch = _batch("llava", model)
    attn = [layer.self_attn for layer in model.model.language_model.layers]
    configs = [a.config for a in attn]
    with apply(cover(), model, proportional_route="channel"):
        seen = []
        hooks = [
            a.register_forward_pre_hook(lambda m, args: seen.append(type(m.config))) for a in attn
        ]
        try:
            model(**batch)
        finally:
            for h in hooks:
                h.remove()
        assert seen == [BiasView] * len(attn)
        assert [a.config for a in attn] == configs  # put back after every call
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS[DISPATCH_KEY]
    x = torch.zeros(1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="only inside a compression session"):
        fn(attn[0], x, x, x, None)


def test_a_quantized_cache_cannot_hold_the_bias_channel(flash):
    """The channel would be quantized with the keys: refused, naming the fix (the mask route
    under sdpa composes with it, `test_quantized_cache.py`)."""
    from transformers.cache_utils import QuantizedCache

    model = get_model("llava")
    cache = QuantizedCache("fp8", model.config)
    with (
        flash_attention(model),
        apply(cover(), model),
        pytest.raises(NotImplementedError, match="bias channel .* quantized cache"),
    ):
        model(**_batch("llava", model), cache=cache, use_cache=True)


# ---------------------------------------------------------------------------- flex_attention
@pytest.fixture
def flex_text(monkeypatch):
    """The decoder under ``flex_attention`` (the vision tower stays on sdpa). Every decoder
    layer of the pipelines used here is compressed, so each runs lightkv's own FlexAttention
    call (unfused on a CPU); transformers' compiled one never runs, which is as well: on this
    CPU (torch 2.13) it fails to compile in generate for the stock model too (an inductor C++
    error). Its mask, a ``BlockMask`` of the uncompressed prompt that it compiles for every
    new length (minutes here) and that no compressed layer reads, is replaced by none."""
    from transformers.masking_utils import AttentionMaskInterface

    monkeypatch.setitem(
        AttentionMaskInterface._global_mapping, "flex_attention", lambda *a, **k: None
    )

    def switch(model):
        config = model.model.language_model.config
        monkeypatch.setattr(config, "_attn_implementation", "flex_attention")
        return model

    return switch


def test_lightkv_cover_under_flex_attention_takes_the_score_mod(flex_text):
    """``attn_implementation="flex_attention"``: every biased layer runs FlexAttention with
    ``score + log_size[b, kv_idx]`` and a BlockMask of lightkv's mask, equal to the sdpa mask
    route to 1e-12 in float64."""
    model = get_model("llava", dtype=torch.float64)
    ref = _reference("llava", torch.float64, cover)
    got = _run(flex_text(model), "llava", cover(), _batch("llava", model), watch=True)
    _assert_equal_to(ref, got, TOL[torch.float64])
    assert dict(got[4].ran) == {"flex_attention": len(got[3].layers)}


def test_a_pipeline_without_the_bias_under_flex_attention_runs_lightkvs_flex(flex_text):
    """Under flex_attention every compressed layer runs lightkv's FlexAttention call (a
    BlockMask of its own mask, no score_mod without the option): DivPrune before the LLM
    equals its sdpa run."""
    model = get_model("llava", dtype=torch.float64)
    batch = _batch("llava", model)
    pipe = get_preset("divprune")
    assert not pipe.proportional_attention
    ref = _run(model, "llava", pipe, batch)
    got = _run(flex_text(model), "llava", pipe, batch, watch=True)
    _assert_equal_to(ref, got, TOL[torch.float64])
    assert dict(got[4].ran) == {"flex_attention": len(got[3].layers)}


def test_the_released_quirks_are_refused_under_flex_attention(flex_text):
    from lightkv.quirks import ReleasedQuirks

    pipe = dataclasses.replace(
        tiny_lightkv(), released_quirks=ReleasedQuirks(renumber_positions=True)
    )
    with pytest.raises(NotImplementedError, match="released code's quirks .* flex_attention"):
        apply(pipe, flex_text(get_model("llava")))
