"""The session report: KV bytes, kept fraction, provenance and FLOP estimates."""

from __future__ import annotations

import json

import pytest
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply

from .conftest import get_model, tiny_lightkv


def test_report_matches_the_cache(family):
    model = get_model(family)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    with apply(tiny_lightkv(), model, **fam.adapter_options) as session:
        out = model(**batch, use_cache=True)
    report = session.report()
    cache = out.cache
    for layer, entry in zip(report.layers, cache.layers):
        nbytes = (
            entry.keys.numel() * entry.keys.element_size()
            + entry.values.numel() * entry.values.element_size()
        )
        assert layer.kv_bytes == nbytes
        assert layer.length == entry.keys.shape[2]
    assert report.kv_bytes < report.kv_bytes_baseline
    assert report.kv_bytes_vision < report.kv_bytes_vision_baseline
    assert report.prefill_flops < report.prefill_flops_baseline
    assert 0 < report.relevance_flops < report.prefill_flops
    layout = session.last_prefill.layout
    v0 = int(layout.vision_mask.sum())
    expected = sum(layer.vision for layer in report.layers) / (len(report.layers) * v0)
    assert report.kept_vision_fraction == pytest.approx(expected)
    assert 0.4 < report.kept_vision_fraction < 1
    # provenance: every prompt vision token is represented by exactly one final token
    owner = report.provenance.owner
    final = session.last_prefill.final_layout
    for b in range(owner.shape[0]):
        vis = layout.vision_mask[b]
        assert (owner[b][vis] >= 0).all()
        represented = sorted(j for srcs in report.sources(b).values() for j in srcs)
        assert represented == sorted(owner[b].ge(0).nonzero().squeeze(1).tolist())
        survivors = final.vision_mask[b].nonzero().squeeze(1).tolist()
        sizes = {i: len(report.sources(b).get(i, [])) for i in survivors}
        assert sum(sizes.values()) == int(vis.sum())
    json.dumps(report.to_dict())
    assert "kept vision fraction" in str(report)


@pytest.mark.parametrize("preset", ["elasticcache", "h2o"])
def test_cache_mode_stages_report_what_each_layer_lost(preset):
    """Regression (issue 27, item 4): ElasticCache's summaries said ``vision_in == vision_out``
    for every stage though each halves its layer's cache, and H2O reported no stage at all."""
    import lightkv

    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:2])
    vision = int((batch["input_ids"] == 100).sum())
    with apply(lightkv.load(preset), model) as session:
        out = model(**batch, use_cache=True)
    report = session.report()
    assert [s.layer for s in report.stages] == list(range(len(out.cache.layers)))
    for s, layer in zip(report.stages, report.layers):
        assert (s.vision_in, s.vision_out) == (vision, layer.vision) and layer.vision < vision
    assert report.kept_vision_fraction == pytest.approx(
        sum(s.vision_out for s in report.stages) / (vision * len(report.stages))
    )


def test_a_budget_the_schedule_cannot_reach_says_so():
    """Regression (issue 27, item 5): the 55% ``lightkv-budget`` keeps about 0.66 on a 4-layer
    model (its stages remove at most half a window each); the report carries target and
    achieved and a warning, and a schedule that keeps its promise has none."""
    import lightkv
    from lightkv.policies.schedulers import TARGET_TOLERANCE

    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:2])
    with apply(lightkv.load("lightkv-budget"), model) as session:
        model(**batch)
    report = session.report()
    assert report.target_kept_fraction == 0.55
    assert report.kept_vision_fraction - 0.55 > TARGET_TOLERANCE
    assert report.missed_target.startswith(
        "pipeline 'lightkv-budget' kept 0.656 of the vision KV, not the 0.550"
    )
    assert "warning: pipeline 'lightkv-budget' kept" in str(report)
    assert report.to_dict()["missed_target"] == report.missed_target
    with apply(tiny_lightkv(), model) as session:
        model(**batch)
    report = session.report()
    assert (
        report.missed_target is None
        and abs(report.kept_vision_fraction - report.target_kept_fraction) < 0.01
    )
