"""`lightkv_lab.bench.image_flow` on the bundled DigitGrid model: the attention-shift share is
exactly one half when a layer attends uniformly, and the read-by-layer sweep covers every
stage position the decoder has."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.bench import image_flow
from lightkv_lab.tasks import model as dg
from lightkv_lab.tasks import scoring as sc


@pytest.fixture(scope="module")
def bundled():
    model, _, grid = dg.load()
    return model, grid, sc.conversations(12, grid, seed=3, followup=False)


def test_a_layer_that_attends_uniformly_puts_half_on_the_bottom_half(bundled):
    model, grid, convs = bundled
    attn = model.model.language_model.layers[0].self_attn
    implementation = model.model.language_model.config._attn_implementation
    saved = attn.q_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            attn.q_proj.weight.zero_()  # every score 0: uniform over the visible tokens
        shift = image_flow.attention_shift(model, convs, grid, batch=5)
    finally:
        with torch.no_grad():
            attn.q_proj.weight.copy_(saved)
    assert shift[0] == pytest.approx(0.5, abs=1e-6)
    assert set(shift) == set(range(model.config.text_config.num_hidden_layers))
    assert all(0.0 <= v <= 1.0 for v in shift.values())
    assert model.model.language_model.config._attn_implementation == implementation


def test_read_by_layer_sweeps_every_stage_position(bundled):
    model, grid, convs = bundled
    base = sc.score(model, convs, grid, None, batch=12)
    read = image_flow.read_by_layer(model, convs, grid, base, batch=12)
    depth = model.config.text_config.num_hidden_layers
    assert list(read) == list(range(depth - 1))
    ref = int(base.correct.sum())
    for value in read.values():  # a count of right answers over the baseline's
        assert value * ref / 100 == pytest.approx(round(value * ref / 100), abs=1e-9)
