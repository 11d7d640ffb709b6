"""The low-budget presets (DivPrune, CDPruner, DART, MMTok, downsampling, lightkv-low-budget,
lightkv-first-layer) inside every family: exact identity at ratio 0, a row alone equals the
row in a padded batch (sdpa and eager), bf16 runs, and families that cannot take a preset
refuse it with a clear error.

VisionZip and VisPruner read the vision tower's attention, which only the LLaVA-1.5 adapter
exposes: `test_tower.py` covers them there and their refusal elsewhere."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply
from lightkv.policies import PreLLMSchedule, average_kept_fraction

from .conftest import assert_rows_match_batch, get_model

GEN = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
PRESETS = (
    "divprune",
    "cdpruner",
    "dart",
    "mmtok",
    "lightkv-cover",
    "downsample",
    "lightkv-low-budget",
    "lightkv-first-layer",
)
REFUSED = {("qwen3_vl", p): "DeepStack" for p in PRESETS if p != "dart"}
"""(family, preset) -> what the refusal says: Qwen3-VL adds visual features in its first
layers (DeepStack), so nothing may leave before they are all added. DART stays after its
layer 1 at any kept fraction (the kept-fraction knob keeps its place), after the tiny
model's DeepStack layers."""


def at(preset: str, target: float):
    return knob_pipeline(preset, 4, target)[0]


def refused(family: str, preset: str, model) -> bool:
    if (family, preset) not in REFUSED:
        return False
    with pytest.raises(NotImplementedError, match=REFUSED[(family, preset)]):
        apply(at(preset, 0.22), model, **TINY_MODELS[family].adapter_options)
    return True


@pytest.mark.parametrize("preset", PRESETS)
def test_identity_at_ratio_zero(family, preset):
    model = get_model(family)
    if refused(family, preset, model):
        return
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    ref = model.generate(**batch, **GEN)
    pipe = at(preset, 0.5)
    sched = pipe.scheduler
    pipe = pipe.with_scheduler(
        replace(sched, removal_ratio=0.0)
        if isinstance(sched, PreLLMSchedule)
        else replace(sched, removal_ratios=(0.0,))
    )
    with apply(pipe, model, **fam.adapter_options):
        gen = model.generate(**batch, **GEN)
    assert torch.equal(gen.sequences, ref.sequences)
    for a, b in zip(
        gen.logits, ref.logits
    ):  # the hooked masks may sum in another order (as test_pre_llm)
        assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_row_alone_equals_row_in_padded_batch(family, preset, attn):
    model = get_model(family, attn)
    if refused(family, preset, model):
        return
    fam = TINY_MODELS[family]
    rows = fam.examples(model)
    batch = fam.collate(rows)
    with apply(at(preset, 0.22), model, **fam.adapter_options) as session:
        together = model.generate(**batch, **GEN)
        assert session.last_prefill is not None
        assert_rows_match_batch(model, fam, batch, rows, GEN, together)


@pytest.mark.parametrize("preset", PRESETS)
def test_bf16_keeps_the_budget_on_llava(preset):
    model = get_model("llava", dtype=torch.bfloat16)
    fam = TINY_MODELS["llava"]
    batch = fam.collate(
        fam.examples(model)[:2]
    )  # three images: one in the first row, two in the second
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    pipe = at(preset, 0.22)
    with apply(pipe, model) as session:
        out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 2
    report = session.report()
    # 64-token images at 22% kept: 64 - floor(0.78 * 64) = 15 each (downsampling: a 3 x 5 grid);
    # DART and lightkv-first-layer compress after a layer (on 4 layers they cannot get below
    # ~26%: what their schedules promise), the pre-LLM presets before every layer
    if preset in ("dart", "lightkv-first-layer"):
        promised = average_kept_fraction(pipe.scheduler.plan(4), 4)
        assert report.kept_vision_fraction == pytest.approx(promised, abs=0.01)
    else:
        assert [(s.vision_in, s.vision_out) for s in report.stages] == [(64 * 3, 15 * 3)]


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_first_layer_keeps_what_low_budget_keeps_with_its_relevance_read_from_the_tap(family):
    """``lightkv-first-layer`` runs ``lightkv-low-budget``'s merge after layer 0 instead of
    before it. The relevance is the same (layer 0's projections of the same inputs), so at
    the same ratio the same tokens survive, per image, in a padded batch; only where each
    source merges differs (layer 0's outputs, not the embeddings). Its relevance is read
    from the layer's own projections (tapped) and costs fewer FLOPs than projecting layer 0's
    query of every token again."""
    from lightkv import get_preset

    model = get_model(family)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    runs = {}
    for name in ("lightkv-first-layer", "lightkv-low-budget"):
        pipe = get_preset(name)
        sched = pipe.scheduler
        pipe = pipe.with_scheduler(
            replace(sched, removal_ratio=0.75)
            if isinstance(sched, PreLLMSchedule)
            else replace(sched, removal_ratios=(0.75,))
        )
        with apply(pipe, model, **fam.adapter_options) as session:
            model(**batch)
        (record,) = session.last_prefill.stages
        runs[name] = (record, session.last_prefill.relevance_flops)
    first, low = runs["lightkv-first-layer"][0], runs["lightkv-low-budget"][0]
    assert first.layer == 0 and first.tapped and not low.tapped
    assert torch.equal(first.result.layout.origin, low.result.layout.origin)
    assert int((first.result.kept_index >= 0).sum()) < first.result.remap.numel()  # it did compress
    assert runs["lightkv-first-layer"][1] < runs["lightkv-low-budget"][1]
