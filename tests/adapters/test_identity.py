"""A pipeline that removes nothing, with every hook path active, changes nothing."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply

from .conftest import get_model, identity_pipeline, tiny_lightkv

GEN = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)


def _batch(family, model, size):
    fam = TINY_MODELS[family]
    rows = fam.examples(model)
    return fam.collate(rows[:1] if size == 1 else rows)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("size", [1, 3])
def test_identity_prefill_and_generation(family, attn, size):
    model = get_model(family, attn)
    fam = TINY_MODELS[family]
    batch = _batch(family, model, size)
    ref = model(**batch).logits
    with apply(identity_pipeline(), model, **fam.adapter_options) as session:
        out = model(**batch).logits
        assert session.last_prefill.stages, "the stages must have run"
        out = session.to_prompt_positions(out)
    valid = batch["attention_mask"].bool()
    assert (out - ref)[valid].abs().max().item() <= 1e-5

    ref_gen = model.generate(**batch, **GEN)
    with apply(identity_pipeline(), model, **fam.adapter_options):
        gen = model.generate(**batch, **GEN)
    assert torch.equal(gen.sequences, ref_gen.sequences)
    for a, b in zip(gen.logits, ref_gen.logits):
        assert (a - b).abs().max().item() <= 1e-5


def test_text_only_prompts_are_untouched(family):
    """No vision tokens: the LightKV pipeline must leave the model exactly as it is."""
    model = get_model(family)
    fam = TINY_MODELS[family]
    rows = [r for r in fam.examples(model) if not r.images]
    batch = fam.collate(rows + [fam.row(model, images=0, pre=2, post=3, seed=7)])
    ref = model(**batch).logits
    ref_gen = model.generate(**batch, **GEN)
    with apply(tiny_lightkv(), model, **fam.adapter_options) as session:
        out = model(**batch).logits
        gen = model.generate(**batch, **GEN)
    assert session.last_prefill.stages == []
    assert torch.equal(out, ref)
    assert torch.equal(gen.sequences, ref_gen.sequences)
