"""The pre-LLM mode inside every family: one stage on the embeddings before layer 0.

Same invariants as the in-prefill stages: identity at ratio 0, every layer's cache as long
as promised, a row alone equals the row in a padded batch; and, on LLaVA, the result equals
the unhooked model run on only the kept embeddings at their original positions.
"""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.adapters import apply
from lightkv.adapters.cache import MaskedCacheLayer
from lightkv.graph.layout import TokenKind
from lightkv.policies import MessagePasser, Partitioner, PreLLMSchedule, Pruner

from .conftest import assert_rows_match_batch, get_model
from .promise import removed_first_stage

GEN = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
# Families whose adapter refuses a stage before layer 0, with the reason it gives.
REFUSED = {"qwen3_vl": "before DeepStack has finished"}


def refused(family, model) -> bool:
    """True (after checking the refusal's message) when the family cannot run a pre-LLM stage."""
    if family not in REFUSED:
        return False
    with pytest.raises(NotImplementedError, match=REFUSED[family]):
        apply(pre_llm(), model, **TINY_MODELS[family].adapter_options)
    return True


def pre_llm(ratio: float = 0.5, passer: str | None = None):
    pipe = lightkv.load("lightkv-pre-llm").with_scheduler(
        PreLLMSchedule(removal_ratio=ratio, windows_per_side=2)
    )
    if passer is not None:
        pipe.passer = MessagePasser.create(passer)
    return pipe


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_identity_at_ratio_zero(family, attn):
    model = get_model(family, attn)
    if refused(family, model):
        return
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    ref = model(**batch).logits
    ref_gen = model.generate(**batch, **GEN)
    with apply(pre_llm(0.0), model, **fam.adapter_options) as session:
        out = session.to_prompt_positions(model(**batch).logits)
        assert [r.layer for r in session.last_prefill.stages] == [0]
        gen = model.generate(**batch, **GEN)
    valid = batch["attention_mask"].bool()
    assert (out - ref)[valid].abs().max().item() <= 1e-5
    assert torch.equal(gen.sequences, ref_gen.sequences)


def test_every_layer_caches_the_compressed_prompt(family):
    model = get_model(family)
    if refused(family, model):
        return
    fam = TINY_MODELS[family]
    rows = fam.examples(model)
    batch = fam.collate(rows)
    with apply(pre_llm(), model, **fam.adapter_options) as session:
        out = model(**batch, use_cache=True)
        gen = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] == batch["input_ids"].shape[1] + 3
    layout = session.last_prefill.layout
    valid = batch["attention_mask"].sum(1).tolist()
    for b in range(len(rows)):
        grids = [
            tuple(g)
            for g, r in zip(layout.image_grid.tolist(), layout.image_row.tolist())
            if r == b
        ]
        removed = sum(removed_first_stage(g, 2, 0.5) for g in grids)
        lengths = [
            int(layer.valid[b].sum())
            for layer in out.cache.layers
            if isinstance(layer, MaskedCacheLayer)
        ]
        assert lengths == [valid[b] - removed] * len(out.cache.layers), (b, lengths)
    assert [s.layer for s in session.report().stages] == [0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_row_alone_equals_row_in_padded_batch(family, attn):
    model = get_model(family, attn)
    if refused(family, model):
        return
    fam = TINY_MODELS[family]
    rows = fam.examples(model)
    batch = fam.collate(rows)
    with apply(pre_llm(), model, **fam.adapter_options):
        together = model.generate(**batch, **GEN)
        assert_rows_match_batch(model, fam, batch, rows, GEN, together)


def test_llava_equals_the_model_on_the_kept_embeddings_at_their_original_positions():
    """Oracle: dropping before layer 0 is the plain model on the surviving embeddings, each at
    its original position (a 1-D RoPE model, so position_ids say it all)."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:1])
    pipe = lightkv.load("lightkv-pre-llm").with_scheduler(
        PreLLMSchedule(removal_ratio=0.5, windows_per_side=2)
    )
    pipe.scorer, pipe.pruner = None, Pruner.create("random", seed=3)
    pipe.passer, pipe.partitioner = (
        MessagePasser.create("drop"),
        Partitioner.create("grid", split="all_src"),
    )
    with apply(pipe, model, record=True) as session:
        logits = model(**batch).logits
    kept = session.records[0].result.layout.origin[0]
    kept = kept[kept >= 0]
    assert kept.numel() < batch["input_ids"].shape[1]
    # the model's own merged embeddings (text + projected image features), then only the kept ones
    captured = {}
    hook = model.model.language_model.register_forward_pre_hook(
        lambda mod, args, kwargs: captured.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True
    )
    try:
        model(**batch)
    finally:
        hook.remove()
    embeds = captured["embeds"][:, kept]
    ref = model.model.language_model(
        inputs_embeds=embeds, position_ids=kept.unsqueeze(0)
    ).last_hidden_state
    ref_logits = model.lm_head(ref)
    assert (logits[0, -1] - ref_logits[0, -1]).abs().max().item() <= 1e-5
    # decoding continues at the original positions: the next token sits at column n, not at
    # len(kept)
    with apply(pipe, model) as session:
        gen = model.generate(
            **batch,
            max_new_tokens=2,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    n = batch["input_ids"].shape[1]
    first = gen.sequences[0, n]
    step = torch.cat([embeds, model.get_input_embeddings()(first.view(1, 1))], dim=1)
    positions = torch.cat([kept, torch.tensor([n])]).unsqueeze(0)
    ref2 = model.lm_head(
        model.model.language_model(inputs_embeds=step, position_ids=positions).last_hidden_state
    )
    assert (gen.logits[1][0] - ref2[0, -1]).abs().max().item() <= 1e-4
    assert int(
        (session.records[0].result.layout.kind == TokenKind.VISION).sum()
    ) == kept.numel() - (batch["input_ids"].shape[1] - int((batch["input_ids"] == 100).sum()))


def test_report_counts_the_prompt_before_the_pre_llm_stage():
    """Regression (issue 27, item 1): the baseline was read after the merge, so the report said
    ``kept_vision_fraction 1.0`` and a stage ``(96, 96)`` while the cache held half the tokens."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:2])
    with apply(pre_llm(), model) as session:
        out = model(**batch, use_cache=True)
    report = session.report()
    vision = int((batch["input_ids"] == 100).sum())
    cached = [int(layer.valid.sum()) for layer in out.cache.layers]
    kept = vision - (batch["attention_mask"].sum().item() - cached[0])
    assert [(s.vision_in, s.vision_out) for s in report.stages] == [(vision, kept)]
    assert report.kept_vision_fraction == pytest.approx(kept / vision)
    assert report.kv_bytes_vision == pytest.approx(report.kv_bytes_vision_baseline * kept / vision)
