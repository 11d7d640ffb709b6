"""Tower relevance and the low-budget pre-LLM presets that read it (VisionZip, VisPruner, SCOPE,
HoloV) or not (downsampling) inside LLaVA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.adapters import apply
from lightkv.policies import PreLLMSchedule

from .conftest import assert_rows_match_batch, get_model

TOWER_PRESETS = ["visionzip", "vispruner", "scope", "holov"]
"""The presets whose relevance is the vision tower's attention (LLaVA family only)."""
GEN = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)


def at(preset: str, ratio: float):
    pipe = lightkv.load(preset)
    return pipe.with_scheduler(PreLLMSchedule(removal_ratio=ratio, windows_per_side=1))


def test_tower_relevance_is_the_towers_own_cls_attention():
    """Oracle: the CLS row of the attention weights transformers returns for the selected layer
    (eager), summed over heads, at each image token's patch."""
    model = get_model("llava", "eager")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:2])
    with apply(at("visionzip", 0.5), model, record=True) as session:
        model(**batch)
    xi = session.records[0].relevance
    tower = model.model.vision_tower(batch["pixel_values"], output_attentions=True)
    cls = tower.attentions[-1][:, :, 0, 1:].sum(dim=1)  # vision_feature_layer -1: the last layer
    layout = session.records[0].layout
    for img in range(layout.num_images):
        mine = layout.image == img
        torch.testing.assert_close(xi[mine], cls[img], rtol=1e-5, atol=1e-6)
    assert float(xi[~layout.vision_mask].abs().sum()) == 0.0


def test_mean_queries_average_the_attention_every_token_receives():
    """``queries: mean`` (SigLIP-style): the attention each patch receives averaged over all
    the tower's queries (CLS included), computed in chunks, against transformers' weights."""
    model = get_model("llava", "eager")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:2])
    pipe = at("visionzip", 0.5)
    pipe = replace(pipe, relevance=replace(pipe.relevance, queries="mean", heads="max"))
    with apply(pipe, model, record=True) as session:
        model(**batch)
    rec = session.records[0]
    tower = model.model.vision_tower(batch["pixel_values"], output_attentions=True)
    want = tower.attentions[-1].mean(dim=2)[:, :, 1:].amax(dim=1)  # [I, patches]
    for img in range(rec.layout.num_images):
        torch.testing.assert_close(
            rec.relevance[rec.layout.image == img], want[img], rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("preset", TOWER_PRESETS + ["downsample"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_rows_alone_equal_rows_in_the_padded_batch(preset, attn):
    model = get_model("llava", attn)
    fam = TINY_MODELS["llava"]
    rows = fam.examples(model)
    batch = fam.collate(rows)
    with apply(at(preset, 1 - 16 / 64), model):
        together = model.generate(**batch, **GEN)
        assert_rows_match_batch(model, fam, batch, rows, GEN, together)


@pytest.mark.parametrize(
    "preset,kept",
    [(p, [7, 14, 28]) for p in TOWER_PRESETS if p != "visionzip"]
    + [("visionzip", [6, 13, 27]), ("downsample", [6, 12, 25])],
)
def test_each_image_keeps_the_requested_count(preset, kept):
    """64-token images at 11%, 22% and 44% kept: exactly ``k`` (HoloV's zero padding
    included); VisionZip ``k - 1`` (one slot is the authors' CLS token's, which LLaVA's prompt
    does not hold); downsampling the near-square grid with the most cells within ``k`` (3 x 2,
    4 x 3, 5 x 5)."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    for share, want in zip((7 / 64, 14 / 64, 28 / 64), kept):
        with apply(at(preset, 1 - share), model) as session:
            model(**batch)
        layout = session.last_prefill.final_layout
        counts = torch.bincount(layout.image[layout.vision_mask], minlength=layout.num_images)
        assert counts.tolist() == [want] * layout.num_images, (share, counts.tolist())


@pytest.mark.parametrize("preset", TOWER_PRESETS + ["downsample"])
def test_identity_at_ratio_zero(preset):
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    ref = model.generate(**batch, **GEN)
    with apply(at(preset, 0.0), model):
        gen = model.generate(**batch, **GEN)
    assert torch.equal(gen.sequences, ref.sequences)
    for a, b in zip(gen.logits, ref.logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("preset", TOWER_PRESETS)
def test_bf16_runs_and_keeps_the_same_count(preset):
    model = get_model("llava", dtype=torch.bfloat16)
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    with apply(at(preset, 1 - 14 / 64), model) as session:
        out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 2
    layout = session.last_prefill.final_layout
    cls_slot = preset == "visionzip"  # the authors' CLS slot stays empty
    assert int(layout.vision_mask.sum()) == (14 - cls_slot) * layout.num_images


@pytest.mark.parametrize("preset", TOWER_PRESETS)
def test_families_without_tower_access_refuse_clearly(preset):
    model = get_model("qwen2_5_vl")
    with pytest.raises(NotImplementedError, match="tower relevance .* supported: llava"):
        apply(at(preset, 0.5), model)


@pytest.mark.parametrize("preset", sorted(set(TOWER_PRESETS) | {"vscan"}))
def test_every_family_but_llava_refuses_the_tower_presets_in_one_line(family, preset):
    if family == "llava":
        return
    model = get_model(family)
    with pytest.raises(
        NotImplementedError, match="tower relevance .* supported: llava|DeepStack"
    ) as err:
        apply(lightkv.load(preset), model, **TINY_MODELS[family].adapter_options)
    assert "\n" not in str(err.value)
