"""Stacking with KV quantization: transformers' ``QuantizedCache`` inside a session.

Invariants: a pipeline that removes nothing gives exactly the quantized cache's own
tokens and logits (greedy on a padded batch, both ways of asking for the cache, and beam
search); LightKV over a quantized cache puts masked quantized layers with the original
settings at the compressed layers, decodes within the quantization error of LightKV alone,
and holds fewer entries in fewer bytes than the uncompressed quantized cache; `kv_bytes`
counts the packed storage; what cannot work is refused with an error naming the fix.

quanto dequantizes 4-bit entries on CPU through a C++ extension that it compiles on first
use (once per environment); the quanto tests are skipped where optimum-quanto is missing,
and fail there under ``--require-quant`` (`make test-quant`, which CI runs).
"""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, QuantizedCache

from lightkv.adapters import apply, kv_bytes
from lightkv.adapters.cache import MaskedCacheLayer, MaskedQuantizedLayer

from .conftest import get_model, identity_pipeline, tiny_lightkv

GEN = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
# head_dim is 16 in the tiny models: one group per token and head; a short residual so that
# decoding flushes it into the quantized entries within a few steps
QUANT = dict(nbits=4, q_group_size=16, residual_length=2)
SETTINGS = ("nbits", "axis_key", "axis_value", "q_group_size", "residual_length")


# the `quanto` fixture: tests/conftest.py (skips without optimum-quanto, fails under
# --require-quant)


@pytest.fixture(scope="module")
def llava():
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:2])
    assert not bool(batch["attention_mask"].all())  # left-padded: rows with holes
    return model, batch


def quantized(model, backend: str = "quanto", **kw) -> QuantizedCache:
    return QuantizedCache(backend, model.config, **({**QUANT, **kw} if backend != "fp8" else kw))


def forced_logits(model, batch, tokens: torch.Tensor, cache: Cache) -> list[torch.Tensor]:
    """Last-position logits of the prefill and of each step fed ``tokens`` ([B, T], the
    same continuation for every variant, so that a near tie cannot send them apart)."""
    out = model(**batch, cache=cache, use_cache=True)
    logits, mask = [out.logits[:, -1]], batch["attention_mask"]
    for t in tokens.T[:-1]:
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        out = model(input_ids=t[:, None], attention_mask=mask, cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return logits


@pytest.mark.parametrize("how", ["cache", "cache_implementation"])
def test_identity_over_a_quantized_cache_is_the_quantized_cache(quanto, llava, how):
    model, batch = llava

    def run():
        if how == "cache":
            return model.generate(**batch, **GEN, cache=quantized(model))
        return model.generate(
            **batch,
            **GEN,
            cache_implementation="quantized",
            cache_config={"backend": "quanto", **QUANT},
        )

    ref = run()
    with apply(identity_pipeline(), model) as session:
        out = run()
    assert session.last_prefill.stages, "the stages must have run"
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))


def test_identity_beam_search_over_a_quantized_cache(quanto, llava):
    model, batch = llava
    beams = dict(
        max_new_tokens=4,
        num_beams=2,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    ref = model.generate(**batch, **beams, cache=quantized(model))
    with apply(identity_pipeline(), model):
        out = model.generate(**batch, **beams, cache=quantized(model))
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.equal(out.sequences_scores, ref.sequences_scores)


def test_lightkv_over_a_quantized_cache(quanto, llava):
    model, batch = llava
    n = batch["attention_mask"].shape[1]

    def error(tokens) -> tuple[list[float], Cache]:
        """Per-step logit error of the quantized cache against the dynamic one, both fed
        ``tokens``."""
        full = forced_logits(model, batch, tokens, DynamicCache(config=model.config))
        cache = quantized(model)
        return [
            (a - b).abs().max().item()
            for a, b in zip(forced_logits(model, batch, tokens, cache), full)
        ], cache

    unhooked, plain_q = error(model.generate(**batch, **GEN).sequences[:, n:])
    with apply(tiny_lightkv(), model) as session:
        tokens = model.generate(**batch, **GEN).sequences[
            :, n:
        ]  # LightKV over the default dynamic cache
        hooked, cache = error(tokens)
        out = model.generate(**batch, **GEN, cache=quantized(model))  # and it generates
    assert out.sequences.shape[1] == n + GEN["max_new_tokens"]
    compressed = min(s.layer for s in session.records) + 1  # the first layer after a stage
    for i, (layer, ref) in enumerate(zip(cache.layers, plain_q.layers)):
        if i >= compressed:
            assert type(layer).__name__ == f"Masked{type(ref).__name__}"
            assert isinstance(layer, MaskedQuantizedLayer) and isinstance(layer, type(ref))
            assert (
                layer.valid.shape[1] == layer.cumulative_length < ref.cumulative_length
            )  # fewer entries
            assert layer.get_seq_length() == ref.get_seq_length()  # the original columns
        else:
            assert type(layer) is type(ref)
        assert (
            all(getattr(layer, k) == getattr(ref, k) for k in SETTINGS) and layer.qtype == ref.qtype
        )
        assert (
            layer._quantized_keys._data.dtype == ref._quantized_keys._data.dtype
        )  # the same packed storage
    # The prefill attends to full-precision states (bit-equal logits), each decoding step to
    # 4-bit entries: with LightKV the error stays within twice the largest the quantized cache
    # makes without it (about 1% of the logits' range on this model).
    assert hooked[0] == unhooked[0] == 0.0
    assert 0.0 < max(unhooked) < 0.05
    assert all(0.0 < e <= 2 * max(unhooked) for e in hooked[1:])
    # fewer bytes: quantized storage plus the residual, holes included
    assert kv_bytes(cache) < kv_bytes(plain_q)
    assert kv_bytes(cache, bookkeeping=True) > kv_bytes(cache)


def test_kv_bytes_counts_the_packed_storage(quanto, llava):
    model, batch = llava
    cache = quantized(model)
    model(**batch, cache=cache, use_cache=True)
    b, h, n, d = (
        batch["input_ids"].shape[0],
        model.config.text_config.num_key_value_heads,
        batch["input_ids"].shape[1],
        model.config.text_config.head_dim,
    )
    groups = b * h * n * d // QUANT["q_group_size"]
    per_tensor = (
        b * h * n * d // 2 + groups * 2 * 4
    )  # 4-bit data, two values a byte; fp32 scale and shift
    assert kv_bytes(cache) == len(cache.layers) * 2 * per_tensor  # the residual is still empty
    step = torch.full((b, 1), 3)
    mask = torch.cat([batch["attention_mask"], torch.ones(b, 1, dtype=torch.long)], dim=1)
    model(
        input_ids=step, attention_mask=mask, cache=cache, use_cache=True
    )  # one entry into the residual
    assert kv_bytes(cache) == len(cache.layers) * 2 * (per_tensor + b * h * d * 4)

    dyn = DynamicCache(config=model.config)
    model(**batch, cache=dyn, use_cache=True)
    assert kv_bytes(dyn) == len(dyn.layers) * 2 * b * h * n * d * 4
    with pytest.raises(TypeError, match="Cache with layers"):
        kv_bytes(((torch.zeros(1), torch.zeros(1)),))


def test_the_fp8_backend_composes_too(llava):
    """Generic over transformers' quantized layers: FP8 (no residual, no extra package)."""
    model, batch = llava
    ref = model.generate(**batch, **GEN, cache=quantized(model, "fp8"))
    cache = quantized(model, "fp8")
    with apply(identity_pipeline(), model):
        out = model.generate(**batch, **GEN, cache=cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))
    assert any(isinstance(layer, MaskedQuantizedLayer) for layer in cache.layers)


# ---------------------------------------------------------------- misuse
def test_the_cache_mode_over_a_quantized_cache_is_refused(quanto, llava):
    import lightkv
    from lightkv.policies import CacheSchedule

    model, batch = llava
    pipe = lightkv.load("elasticcache").with_scheduler(
        CacheSchedule(removal_ratio=0.5, layers=(1, 3))
    )
    with (
        apply(pipe, model),
        pytest.raises(TypeError, match=r"cache mode.*\[1, 3\].*use a DynamicCache"),
    ):
        model.generate(**batch, **GEN, cache=quantized(model))


def test_a_group_size_the_compressed_layer_cannot_take_names_the_fix(quanto, llava):
    """quanto's groups must divide ``kv_heads * entries * head_dim`` (axis 0): 274 divides
    the 137-column prompt's, not a compressed layer's."""
    model, batch = llava
    model(**batch, cache=quantized(model, q_group_size=274), use_cache=True)  # fine unhooked
    with (
        apply(tiny_lightkv(), model),
        pytest.raises(ValueError, match=r"compressed cache layer.*divisor of kv_heads"),
    ):
        model(**batch, cache=quantized(model, q_group_size=274), use_cache=True)


def masked_layers(cache: Cache) -> list[MaskedQuantizedLayer]:
    layers = [layer for layer in cache.layers if isinstance(layer, MaskedQuantizedLayer)]
    assert layers
    return layers


def test_row_operations_the_quantized_layer_cannot_do_are_refused(quanto, llava):
    """transformers' quantized layers repeat and select only their residual; the masked
    ones refuse (the unmasked layers before the first stage are transformers' own)."""
    model, batch = llava
    cache = quantized(model)
    with apply(tiny_lightkv(), model):
        model(**batch, cache=cache, use_cache=True)
    for layer in masked_layers(cache):
        with pytest.raises(
            NotImplementedError, match="batch_repeat_interleave.*quantized entries.*DynamicCache"
        ):
            layer.batch_repeat_interleave(2)
        with pytest.raises(NotImplementedError, match="batch_select_indices.*quantized entries"):
            layer.batch_select_indices(torch.tensor([1, 0]))
        assert layer.valid.shape[0] == 2  # untouched


def test_beam_search_without_a_quantization_aware_reorder_is_refused(quanto, llava):
    """A quantized layer whose ``reorder_cache`` is the plain one (it would reorder the
    residual only) is refused when beam search reorders it."""
    from transformers.cache_utils import QuantoQuantizedLayer

    class ResidualOnlyReorder(QuantoQuantizedLayer):
        reorder_cache = DynamicLayer.reorder_cache

    model, batch = llava
    cache = Cache(
        layers=[
            ResidualOnlyReorder(**QUANT) for _ in range(model.config.text_config.num_hidden_layers)
        ]
    )
    with apply(tiny_lightkv(), model):
        model(**batch, cache=cache, use_cache=True)
    for layer in masked_layers(cache):
        assert type(layer).__name__ == "MaskedResidualOnlyReorder"
        with pytest.raises(NotImplementedError, match="reorder_cache.*beam search would mix rows"):
            layer.reorder_cache(torch.tensor([1, 0]))


def test_masked_layers_stay_masked_layers():
    """The dynamic path is unchanged: a fresh DynamicCache gets plain `MaskedCacheLayer`s."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    cache = DynamicCache(config=model.config)
    with apply(tiny_lightkv(), model):
        model(**fam.collate(fam.examples(model)[:1]), cache=cache, use_cache=True)
    masked = [layer for layer in cache.layers if isinstance(layer, MaskedCacheLayer)]
    assert masked and all(type(layer) is MaskedCacheLayer for layer in masked)
