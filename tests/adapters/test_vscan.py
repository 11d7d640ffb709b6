"""The ``vscan`` preset inside LLaVA: its two stages (scan and merge before the LLM, then the
last token's attention after the middle layer) keep the promised counts, rows alone equal rows
in the padded batch (sdpa and eager), bf16 runs, ratio 0 is the identity, the local scan reads
the tower layer it names and the second stage the last token's attention, a tower too shallow
for the local scan's layer and the families without tower attention refuse it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.adapters import apply

from .conftest import assert_rows_match_batch, get_model

GEN = {
    "max_new_tokens": 3,
    "do_sample": False,
    "output_logits": True,
    "return_dict_in_generate": True,
}


def vscan(first: float = 5 / 6, later: float = 0.6666666666666667, local_layer: int | None = 0):
    """The preset at other ratios; its local scan reads tower layer ``local_layer`` (the tiny
    tower has one layer, 0; the preset's 5 is CLIP ViT-L's)."""
    pipe = lightkv.load("vscan")
    pipe = replace(pipe, partitioner=replace(pipe.partitioner, local_layer=local_layer))
    return pipe.with_scheduler(
        replace(pipe.scheduler, removal_ratio=first, later_removal_ratio=later)
    )


def test_a_tower_too_shallow_for_the_local_scan_is_refused_in_one_line():
    model = get_model("llava")
    with pytest.raises(ValueError) as e:
        apply(lightkv.load("vscan"), model)
    assert str(e.value) == (
        "the vscan_scan partitioner reads vision tower layer 5, but this model's vision tower has "
        "layers 0-0 only: set its local_layer to a layer the tower has"
    )


def test_the_local_scan_reads_the_cls_attention_of_its_tower_layer():
    model = get_model("llava", "eager")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:2])
    with apply(vscan(), model, record=True) as session:
        model(**batch)
    rec = session.records[0]
    tower = model.model.vision_tower(batch["pixel_values"], output_attentions=True)
    cls = tower.attentions[0][:, :, 0, 1:]  # [images, heads, patches]: layer 0's CLS row
    layout = rec.layout
    for img in range(layout.num_images):
        mine = (layout.image == img) & layout.vision_mask
        row = int(mine.any(1).nonzero()[0])
        torch.testing.assert_close(rec.tower[0][row][:, mine[row]], cls[img], rtol=1e-5, atol=1e-6)


def test_two_stages_keep_the_promised_counts():
    """64-token images: 64 - floor(5/6 * 64) = 11 before the LLM, 11 - floor(2/3 * 11) = 4
    after layer 1 of the 4 (the middle), per image."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    with apply(vscan(), model) as session:
        model.generate(**batch, max_new_tokens=2, do_sample=False)
    report = session.report()
    images = 3
    assert [(s.vision_in, s.vision_out) for s in report.stages] == [
        (64 * images, 11 * images),
        (11 * images, 4 * images),
    ]
    assert [s.layer for s in session.last_prefill.stages] == [0, 1]


def test_the_later_stage_keeps_what_the_last_token_attends_to_most():
    model = get_model("llava", "eager")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:1])
    with apply(vscan(), model, record=True) as session:
        model(**batch)
    first, later = session.records[0], session.records[1]
    assert not torch.equal(first.relevance, later.relevance)  # tower attention, then the LLM's own
    vision = later.layout.vision_mask[0]
    xi = later.relevance[0].masked_fill(~vision, -1.0)
    want = torch.sort(xi, descending=True, stable=True).indices[
        : int(later.result.layout.vision_counts()[0])
    ]
    kept = later.result.layout.origin[0][later.result.layout.vision_mask[0]]
    assert sorted(later.layout.origin[0][want].tolist()) == sorted(kept.tolist())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_row_alone_equals_row_in_padded_batch(attn):
    model = get_model("llava", attn)
    fam = TINY_MODELS["llava"]
    rows = fam.examples(model)
    batch = fam.collate(rows)
    with apply(vscan(), model):
        together = model.generate(**batch, **GEN)
        assert_rows_match_batch(model, fam, batch, rows, GEN, together)


def test_identity_at_ratio_zero():
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    ref = model.generate(**batch, **GEN)
    with apply(vscan(0.0, 0.0), model):
        gen = model.generate(**batch, **GEN)
    assert torch.equal(gen.sequences, ref.sequences)
    for a, b in zip(gen.logits, ref.logits):
        assert (a - b).abs().max().item() <= 1e-5


def test_bf16_runs_and_keeps_the_counts():
    model = get_model("llava", dtype=torch.bfloat16)
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    with apply(vscan(), model) as session:
        out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == batch["input_ids"].shape[1] + 2
    assert [s.vision_out for s in session.report().stages] == [33, 12]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_families_without_tower_access_refuse_clearly(family):
    model = get_model(family)
    with pytest.raises(NotImplementedError, match="tower relevance .* supported: llava"):
        apply(vscan(), model, **TINY_MODELS[family].adapter_options)
