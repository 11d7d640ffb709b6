"""The LightKV preset on a tiny schedule: cache lengths as promised, generation completes,
and a row gives the same result alone or inside a padded batch."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply
from lightkv.adapters.cache import MaskedCacheLayer
from lightkv.graph.layout import TokenKind

from .conftest import get_model, tiny_lightkv
from .promise import promised_vision

GEN = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)


def _row_grids(layout, row: int) -> list[tuple[int, int]]:
    return [
        tuple(g) for g, r in zip(layout.image_grid.tolist(), layout.image_row.tolist()) if r == row
    ]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cache_lengths_match_the_schedule(family, attn):
    model = get_model(family, attn)
    fam = TINY_MODELS[family]
    rows = fam.examples(model)
    batch = fam.collate(rows)
    with apply(tiny_lightkv(), model, **fam.adapter_options) as session:
        out = model(**batch, use_cache=True)
        gen = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == batch["input_ids"].shape[1] + 5
    layout = session.last_prefill.layout
    cache = out.cache
    valid = batch["attention_mask"].sum(1).tolist()
    for b in range(len(rows)):
        v0, v1, v2 = promised_vision(_row_grids(layout, b), (2, 1), 0.5)
        assert int((layout.kind[b] == TokenKind.VISION).sum()) == v0
        expected = [valid[b], valid[b], valid[b] - (v0 - v1), valid[b] - (v0 - v2)]
        got = []
        for layer in cache.layers:
            if isinstance(layer, MaskedCacheLayer):
                got.append(int(layer.valid[b].sum()))
            else:
                got.append(int(batch["attention_mask"][b].sum()))
        assert got == expected, (b, got, expected)
    # the cache tensors are no wider than the longest row needs
    for layer in cache.layers[2:]:
        assert layer.keys.shape[2] == int(layer.valid.sum(1).max())


def test_single_row_cache_is_exactly_the_promised_length(family):
    model = get_model(family)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model)[:1])
    with apply(tiny_lightkv(), model, **fam.adapter_options) as session:
        out = model(**batch, use_cache=True)
    n0 = batch["input_ids"].shape[1]
    v0, v1, v2 = promised_vision(_row_grids(session.last_prefill.layout, 0), (2, 1), 0.5)
    assert [layer.keys.shape[2] for layer in out.cache.layers] == [
        n0,
        n0,
        n0 - (v0 - v1),
        n0 - (v0 - v2),
    ]
    report = session.report()
    assert [layer.length for layer in report.layers] == [n0, n0, n0 - (v0 - v1), n0 - (v0 - v2)]
    assert report.kept_vision_fraction == pytest.approx((2 * v0 + v1 + v2) / (4 * v0))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_row_alone_equals_row_in_padded_batch(family, attn):
    model = get_model(family, attn)
    fam = TINY_MODELS[family]
    rows = fam.examples(model)
    with apply(tiny_lightkv(), model, **fam.adapter_options):
        together = model.generate(**fam.collate(rows), **GEN)
        for i, row in enumerate(rows):
            alone = model.generate(**fam.collate([row]), **GEN)
            assert torch.equal(alone.sequences[0, -5:], together.sequences[i, -5:])
            for a, b in zip(alone.logits, together.logits):
                assert (a[0] - b[i]).abs().max().item() <= 1e-4


def test_beam_search_and_sampling(family):
    model = get_model(family)
    fam = TINY_MODELS[family]
    if fam.beam_search:
        pytest.skip(fam.beam_search)
    rows = fam.examples(model)
    batch = fam.collate(rows)
    beams = dict(
        max_new_tokens=4,
        num_beams=3,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with apply(tiny_lightkv(), model, **fam.adapter_options):
        together = model.generate(**batch, **beams)
        for i, row in enumerate(rows):
            alone = model.generate(**fam.collate([row]), **beams)
            assert torch.equal(alone.sequences[0, -4:], together.sequences[i, -4:])
            assert (
                abs(float(alone.sequences_scores[0]) - float(together.sequences_scores[i])) <= 1e-4
            )
        torch.manual_seed(0)
        sampled = model.generate(**batch, max_new_tokens=4, do_sample=True)
    assert sampled.shape[1] == batch["input_ids"].shape[1] + 4


def test_beam_search_with_identity_pipeline_equals_model(family):
    model = get_model(family)
    fam = TINY_MODELS[family]
    if fam.beam_search:
        pytest.skip(fam.beam_search)
    batch = fam.collate(fam.examples(model))
    beams = dict(
        max_new_tokens=4,
        num_beams=2,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    ref = model.generate(**batch, **beams)
    from .conftest import identity_pipeline

    with apply(identity_pipeline(), model, **fam.adapter_options):
        got = model.generate(**batch, **beams)
    assert torch.equal(ref.sequences, got.sequences)
    assert (ref.sequences_scores - got.sequences_scores).abs().max().item() <= 1e-5
    torch.manual_seed(3)
    ref = model.generate(**batch, max_new_tokens=4, do_sample=True)
    with apply(identity_pipeline(), model, **fam.adapter_options):
        torch.manual_seed(3)
        got = model.generate(**batch, max_new_tokens=4, do_sample=True)
    assert torch.equal(ref, got)
