"""Misuse of a session meets a clear error, never a silent no-op (issue 13, part B)."""

from __future__ import annotations

import gc

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply

from .conftest import get_model, tiny_lightkv


def _fresh_llava():
    return TINY_MODELS["llava"].build()


def test_a_compiled_wrapper_is_refused():
    model = _fresh_llava()
    fam = TINY_MODELS["llava"]
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(TypeError, match="torch.compile'd model.*_orig_mod"):
        apply(tiny_lightkv(), compiled)
    with pytest.raises(TypeError, match="torch.compile wrapper of this model exists"):
        apply(tiny_lightkv(), model)
    del compiled
    gc.collect()
    with apply(tiny_lightkv(), model) as session:  # without the wrapper the model compresses
        model(**fam.collate(fam.examples(model)[:1]))
    assert session.last_prefill is not None and session.records


def test_a_model_compiled_in_place_is_refused():
    model = _fresh_llava()
    model.model.language_model.layers[1].compile(backend="eager")
    with pytest.raises(TypeError, match="compiled in place"):
        apply(tiny_lightkv(), model)


def test_a_static_cache_on_a_padded_batch_names_the_cache_not_the_mask():
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:2])
    assert not bool(batch["attention_mask"].all())  # padded
    with (
        apply(tiny_lightkv(), model),
        pytest.raises(TypeError, match="default dynamic cache only.*Static"),
    ):
        model.generate(**batch, max_new_tokens=2, do_sample=False, cache_implementation="static")


def test_a_4d_mask_is_named_as_such():
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:1])
    n = batch["input_ids"].shape[1]
    batch["attention_mask"] = torch.ones(1, 1, n, n)
    with apply(tiny_lightkv(), model), pytest.raises(ValueError, match="got a 4-D mask"):
        model(**batch)


def test_a_text_model_whose_config_says_llava_gets_a_clear_error():
    """Regression (issue 27, item 12): a Llama whose ``model_type`` says ``llava`` raised a raw
    AttributeError from deep in the adapter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import lightkv

    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(cfg)
    model.config.model_type = "llava"
    with pytest.raises(TypeError, match="cannot find the multimodal core"):
        lightkv.apply(lightkv.load("lightkv"), model)
