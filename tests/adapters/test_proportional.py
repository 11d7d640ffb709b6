"""Proportional attention (`Pipeline.proportional_attention`): every layer after a merge adds
``log(size)`` of each key to its attention logits, in prefill and decoding.

Invariants: while no token stands for more than one, the option changes nothing, bit for
bit (nothing removed = the unhooked model; tokens dropped but none merged = the option
off); a row alone equals the row in a padded batch (greedy and beam search); and, the
reference, the duplicate-keys identity: the model's own layers run on a sequence (prefill)
or a cache (decoding) in which every merged token is repeated ``size`` times, with a plain
causal mask and no bias, give the biased result to 1e-5, in the in-prefill mode, the
pre-LLM mode and the cache mode (ElasticCache's merges).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv import Pipeline
from lightkv.adapters import apply
from lightkv.adapters.base import Adapter
from lightkv.adapters.cache import MaskedCacheLayer
from lightkv.adapters.llava import LlavaAdapter
from lightkv.policies import CacheSchedule, ExplicitSchedule, PreLLMSchedule

from .conftest import (
    assert_rows_match_batch,
    decoder_layers,
    get_model,
    identity_pipeline,
    tiny_lightkv,
)

GEN = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
REFERENCE_FAMILIES = [
    "llava",
    "qwen2_5_vl",
    "gemma3",
]  # 1-D RoPE; 3-D M-RoPE; image blocks + sliding layers


def prop(pipe: Pipeline, on: bool = True) -> Pipeline:
    return dataclasses.replace(pipe, proportional_attention=on)


def drop_only() -> Pipeline:
    """Removes half of each window's vision tokens without merging them: every size stays 1."""
    return lightkv.load("fastv").with_scheduler(
        ExplicitSchedule(layers=(1, 2), windows_per_side=(2, 1), removal_ratios=(0.5,))
    )


def pre_llm() -> Pipeline:
    return lightkv.load("lightkv-pre-llm").with_scheduler(
        PreLLMSchedule(removal_ratio=0.5, windows_per_side=2)
    )


def elastic() -> Pipeline:
    return lightkv.load("elasticcache").with_scheduler(
        CacheSchedule(removal_ratio=0.5, layers=(0, 1, 3))
    )


MODES = {"in-prefill": tiny_lightkv, "pre-llm": pre_llm, "cache": elastic}


# ---------------------------------------------------------------------------- identity
# Every family under sdpa; eager (the same additive mask, another kernel) on the reference
# families, and there also by the duplicated-key oracles below.
ATTN_BY_FAMILY = [("sdpa", f) for f in TINY_MODELS] + [("eager", f) for f in REFERENCE_FAMILIES]


@pytest.mark.parametrize(("attn", "family"), ATTN_BY_FAMILY)
def test_nothing_merged_is_bit_exact(family, attn):
    model = get_model(family, attn)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    valid = batch["attention_mask"].bool()
    ref = model(**batch).logits
    with apply(prop(identity_pipeline()), model, **fam.adapter_options) as session:
        out = session.to_prompt_positions(model(**batch).logits)
    assert torch.equal(out[valid], ref[valid])  # nothing removed: the unhooked model

    results = {}
    for on in (False, True):  # tokens dropped, none merged: the option off
        with apply(prop(drop_only(), on), model, **fam.adapter_options) as session:
            logits = model(**batch).logits
            gen = model.generate(**batch, **GEN)
        if session.last_prefill.stages:
            assert int(session.last_prefill.provenance.sizes().max()) == 1
        results[on] = logits, gen
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1].sequences, results[False][1].sequences)
    for a, b in zip(results[True][1].logits, results[False][1].logits):
        assert torch.equal(a, b)


def test_the_option_changes_merged_results():
    """Not silently ignored: with merges the logits move, and the merged layers carry sizes."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    with apply(tiny_lightkv(), model):
        off = model(**batch).logits
    with apply(prop(tiny_lightkv()), model):
        out = model(**batch, use_cache=True)
    assert (out.logits - off).abs().max().item() > 1e-3
    carried = [
        isinstance(layer, MaskedCacheLayer) and layer.sizes is not None
        for layer in out.cache.layers
    ]
    assert carried == [False, False, True, True]  # stages after layers 1 and 2


# ---------------------------------------------------------------------------- batches
@pytest.mark.parametrize(("attn", "family"), ATTN_BY_FAMILY)
def test_row_alone_equals_row_in_padded_batch(family, attn):
    model = get_model(family, attn)
    fam = TINY_MODELS[family]
    rows = fam.examples(model)
    batch = fam.collate(rows)
    with apply(prop(tiny_lightkv()), model, **fam.adapter_options) as session:
        together = model.generate(**batch, **GEN)
        assert int(session.last_prefill.provenance.sizes().max()) > 1
        assert_rows_match_batch(model, fam, batch, rows, GEN, together)


def test_beam_search_carries_the_sizes():
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    rows = fam.examples(model)
    beams = dict(
        max_new_tokens=4,
        num_beams=3,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with apply(prop(tiny_lightkv()), model):
        together = model.generate(**fam.collate(rows), **beams)
        for i, row in enumerate(rows):
            alone = model.generate(**fam.collate([row]), **beams)
            assert torch.equal(alone.sequences[0, -4:], together.sequences[i, -4:])
            assert (
                abs(float(alone.sequences_scores[0]) - float(together.sequences_scores[i])) <= 1e-4
            )


# ---------------------------------------------------------------------------- refusals
def test_a_family_that_cannot_is_refused_by_name():
    class NoBias(LlavaAdapter):
        proportional_attention_refused = "its attention kernel takes no additive mask"

    model = get_model("llava")
    apply(tiny_lightkv(), model, adapter=NoBias(model))  # the option off: fine
    with pytest.raises(
        NotImplementedError,
        match=r"'llava' family: its attention kernel.*proportional_attention: false",
    ):
        apply(prop(tiny_lightkv()), model, adapter=NoBias(model))


def test_a_family_without_additive_masks_fails_clearly():
    class BoolMasks(LlavaAdapter):
        def prefill_mask(self, layer, origin, valid, impl, dtype):
            return Adapter.prefill_mask(self, layer, origin, valid, "sdpa", dtype)  # never float

    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    with (
        apply(prop(tiny_lightkv()), model, adapter=BoolMasks(model)),
        pytest.raises(TypeError, match="additive float mask.*'llava' adapter"),
    ):
        model(**fam.collate(fam.examples(model)))


# ---------------------------------------------------------------------------- the reference
def _duplicate(sizes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, M]``: for every column of a sequence in which each real token is repeated
    ``size`` times (holes once), the compressed column it copies; ``-1`` for left padding."""
    reps = torch.where(valid, sizes.clamp_min(1), torch.ones_like(sizes))
    width = int(reps.sum(1).max())
    index = torch.full((sizes.shape[0], width), -1, dtype=torch.long)
    for r in range(sizes.shape[0]):
        seq = torch.repeat_interleave(torch.arange(sizes.shape[1]), reps[r].cpu())
        index[r, width - seq.numel() :] = seq
    return index


def _take(
    t: torch.Tensor, index: torch.Tensor, dim: int, fill=None, batch: int = 0
) -> torch.Tensor:
    """``t`` gathered along its token axis ``dim`` by ``index`` ``[B, M]`` (``-1``: ``fill``,
    or any column when ``fill`` is None); ``batch`` is its batch axis (a size of 1 is
    broadcast)."""
    shape = list(t.shape)
    shape[batch] = index.shape[0]
    t = t.expand(*shape)
    view = [1] * t.dim()
    view[batch], view[dim] = index.shape
    shape[dim] = index.shape[1]
    out = t.gather(dim, index.clamp_min(0).view(view).expand(*shape))
    if fill is not None:
        out = out.masked_fill((index < 0).view(view), fill)
    return out


def _plain_mask(
    adapter, layer: int, origin: torch.Tensor, valid: torch.Tensor, impl: str, dtype
) -> torch.Tensor:
    """The reference's mask, without any bias: causal by original order, padding hidden,
    each padding row attending to itself; a family with its own pattern (Gemma 3) gives it."""
    if type(adapter).prefill_mask is not Adapter.prefill_mask:
        return adapter.prefill_mask(layer, origin, valid, "eager", dtype)
    allowed = (origin[:, None, :] <= origin[:, :, None]) & valid[:, None, :] & valid[:, :, None]
    allowed = (allowed | torch.eye(origin.shape[1], dtype=torch.bool))[:, None]
    if impl == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _stage_sizes(session, layer: int):
    """Sizes, origins and validity of the tokens layer ``layer`` runs on (None: no stage yet)."""
    records = [
        r
        for r in session.records
        if r.layer < layer or (r.stage.spec.mode == "pre_llm" and r.layer <= layer)
    ]
    if not records:
        return None
    res = records[-1].result
    return res.sizes, res.layout.origin, res.layout.valid_mask


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["in-prefill", "pre-llm"])
@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
def test_prefill_equals_duplicated_keys(family, mode, attn):
    model = get_model(family, attn)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    layers = decoder_layers(model)
    inputs, outputs, hooks = {}, {}, []

    def keep_input(i, module, args, kwargs):
        inputs[i] = (args, dict(kwargs))

    def keep_output(i, module, args, kwargs, output):
        outputs[i] = output[0] if isinstance(output, tuple) else output

    with apply(prop(MODES[mode]()), model, record=True, **fam.adapter_options) as session:
        for i, layer in enumerate(layers):  # after the session's pre-hooks, before its stage hooks
            hooks.append(
                layer.register_forward_pre_hook(
                    lambda m, a, k, i=i: keep_input(i, m, a, k), with_kwargs=True
                )
            )
            hooks.append(
                layer.register_forward_hook(
                    lambda m, a, k, o, i=i: keep_output(i, m, a, k, o),
                    with_kwargs=True,
                    prepend=True,
                )
            )
        try:
            model(**batch)
        finally:
            for h in hooks:
                h.remove()
    checked = 0
    for i, layer in enumerate(layers):
        state = _stage_sizes(session, i)
        if state is None:
            continue
        sizes, origin, valid = state
        # only merges remove tokens: the sizes account for every prompt token
        assert torch.equal((sizes * valid).sum(1), batch["attention_mask"].sum(1))
        args, kwargs = inputs[i]
        hidden = args[0] if args else kwargs.pop("hidden_states")
        assert hidden.shape[1] == sizes.shape[1]
        index = _duplicate(sizes, valid)
        dup_valid = _take(valid, index, 1, False)
        dup_origin = _take(origin, index, 1, -1)
        kwargs.update(
            attention_mask=_plain_mask(
                session.adapter, i, dup_origin, dup_valid, attn, hidden.dtype
            ),
            position_embeddings=tuple(_take(t, index, 1) for t in kwargs["position_embeddings"]),
            use_cache=False,
        )
        for key in ("cache", "past_key_values"):
            if key in kwargs:
                kwargs[key] = None
        ids = kwargs.get("position_ids")
        if ids is not None:  # [B, N], or [k, B, N] (M-RoPE)
            ids = ids if ids.dim() > 1 else ids[None]
            kwargs["position_ids"] = _take(ids, index, ids.dim() - 1, batch=ids.dim() - 2)
        ref = layer(_take(hidden, index, 1, 0.0), *args[1:], **kwargs)
        ref = ref[0] if isinstance(ref, tuple) else ref
        got = _take(outputs[i], index, 1)
        assert (ref - got)[dup_valid].abs().max().item() <= 1e-5, (family, mode, attn, i)
        checked += 1
    first = min(r.layer for r in session.records)
    assert checked == (len(layers) - 1 - first if mode == "in-prefill" else len(layers) - first)


def _snapshot(cache) -> tuple:
    """What the reference needs of a cache before a decoding step changes it."""
    plain = {
        i: copy.copy(layer)
        for i, layer in enumerate(cache.layers)
        if not isinstance(layer, MaskedCacheLayer)
    }
    masked = {
        i: (layer.keys, layer.values, layer.valid, layer.origin, layer.sizes, layer.columns)
        for i, layer in enumerate(cache.layers)
        if isinstance(layer, MaskedCacheLayer)
    }
    return copy.copy(cache), plain, masked


def _duplicated_cache(snapshot, token):
    """The cache with every merged entry repeated ``size`` times (no sizes: no bias)."""
    cache, plain, masked = snapshot
    layers = []
    for i in range(len(plain) + len(masked)):
        if i in plain:
            layers.append(plain[i])
            continue
        keys, values, valid, origin, sizes, columns = masked[i]
        index = _duplicate(sizes if sizes is not None else torch.ones_like(origin), valid)
        layer = MaskedCacheLayer(token)
        layer.pending, layer.pending_origin = (
            _take(valid, index, 1, False),
            _take(origin, index, 1, -1),
        )
        layer.pending_columns = columns
        layer.update(_take(keys, index, 2, 0.0), _take(values, index, 2, 0.0))
        layers.append(layer)
    cache.layers = layers
    return cache


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
def test_decoding_equals_duplicated_cache(family, mode, attn):
    """Replays generate's decoding calls on the duplicated cache, with the option off."""
    model = get_model(family, attn)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    calls, snapshot = [], []

    def keep_call(module, args, kwargs):
        if calls and not snapshot:  # the first decoding step: the cache is the prefill's
            snapshot.append(_snapshot(kwargs["cache"]))
        calls.append(dict(kwargs))

    hook = model.register_forward_pre_hook(keep_call, with_kwargs=True)
    try:
        with apply(prop(MODES[mode]()), model, **fam.adapter_options):
            gen = model.generate(
                **batch, **dict(GEN, max_new_tokens=3)
            )  # step 2 reads a decoded token of size 1
        cache = calls[-1]["cache"]
        for layer in cache.layers:
            if isinstance(layer, MaskedCacheLayer) and layer.sizes is not None:
                assert layer.sizes.shape == layer.valid.shape and bool(
                    (layer.sizes[:, -2:] == 1).all()
                )
    finally:
        hook.remove()
    assert any(sizes is not None for *_, sizes, _ in snapshot[0][2].values())
    assert len(calls) == 3
    with apply(prop(MODES[mode](), False), model, **fam.adapter_options) as reference:
        model(
            **dict(calls[0], cache=None, use_cache=False)
        )  # the same prefill state (Qwen's rope deltas)
        dup = _duplicated_cache(snapshot[0], reference._token)
        for kwargs, biased in zip(calls[1:], gen.logits[1:]):
            step = model(**dict(kwargs, cache=dup))
            assert (step.logits[:, -1] - biased).abs().max().item() <= 1e-5, (family, mode, attn)
