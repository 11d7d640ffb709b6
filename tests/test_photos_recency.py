"""The Photos decoder's recency prior (`lightkv_lab.tasks.photos.recency`): the stock Llama
attention with the prior's biases adds, at every query-key distance, the logit the module's
closed form names; nothing else in the model changes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkv_lab.tasks.photos.model import PhotosSpec, build_model
from lightkv_lab.tasks.photos.recency import (
    SPAN,
    install_recency_prior,
    prior_params,
    recency_logits,
)


def _model(layers: int, strength: float, bias: bool = True):
    model = build_model(PhotosSpec(attention_bias=bias), seed=0, tower=False)
    if bias:
        install_recency_prior(model, layers, strength)
    model.model.language_model.config._attn_implementation = "eager"
    return model


def _last_row_logits(model, layer: int, n: int) -> torch.Tensor:
    """Log attention of the last query in ``layer`` (head 0) over ``n`` equal tokens, with the
    layer's content projections zeroed: what is left is the biases' term."""
    attn = model.model.language_model.layers[layer].self_attn
    with torch.no_grad():
        attn.q_proj.weight.zero_()
        attn.k_proj.weight.zero_()
        out = model.model.language_model(input_ids=torch.full((1, n), 5), output_attentions=True)
    return out.attentions[layer][0, 0, -1].double().log()


@settings(max_examples=8, deadline=None)
@given(strength=st.floats(0.5, 12.0), n=st.integers(20, 300))
def test_the_prior_adds_its_closed_form_at_every_distance(strength, n):
    model = _model(2, strength)
    logits = _last_row_logits(model, 1, n)
    # an independent oracle: RoPE rotates pair j = (j, j + 16) by distance x 10000^(-j/16)
    d = torch.arange(n - 1, -1, -1, dtype=torch.float64)
    freq = 10000.0 ** (-torch.tensor([8.0, 9.0]) / 16)
    shape = torch.cos(d[:, None] * freq).sum(-1)
    span = (1 - torch.cos(SPAN * freq)).sum()
    oracle = strength * (shape - shape[-1]) / span
    assert torch.allclose(logits - logits[-1], oracle, atol=1e-5)
    closed = recency_logits(d, 32, 10000.0, strength)
    assert torch.allclose(closed - closed[-1], oracle, atol=1e-12)


def test_strength_is_the_drop_from_distance_zero_to_the_span():
    d = torch.tensor([0.0, float(SPAN)])
    drop = recency_logits(d, 32, 10000.0, 7.0)
    assert math.isclose(float(drop[0] - drop[1]), 7.0, rel_tol=1e-12)
    near_to_far = recency_logits(torch.arange(0.0, SPAN + 1), 32, 10000.0, 1.0)
    assert bool((near_to_far[1:] < near_to_far[:-1]).all())  # monotone over the span


def test_layers_after_the_prior_are_untouched_and_its_biases_are_listed():
    model = _model(2, 6.0)
    layers = model.model.language_model.layers
    assert layers[0].self_attn.q_proj.bias.abs().sum() > 0
    assert layers[1].self_attn.k_proj.bias.abs().sum() > 0
    for layer in layers[2:]:
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert getattr(layer.self_attn, proj).bias.abs().sum() == 0
    flat = _last_row_logits(model, 2, 50)  # content zeroed, no prior: uniform attention
    assert torch.allclose(flat, torch.full_like(flat, -math.log(50)), atol=1e-6)
    ids = prior_params(model)
    assert len(ids) == 4 * len(layers)
    decoder = model.model.language_model.named_parameters()
    assert all(id(p) in ids for n, p in decoder if n.endswith("proj.bias"))


def test_zero_strength_equals_the_model_without_biases():
    plain = build_model(PhotosSpec(), seed=0, tower=False)
    biased = build_model(PhotosSpec(attention_bias=True), seed=0, tower=False)
    biased.load_state_dict(plain.state_dict(), strict=False)
    install_recency_prior(biased, 2, 0.0)
    ids = torch.randint(4, 60, (2, 40))
    with torch.no_grad():
        a = plain.model.language_model(input_ids=ids).last_hidden_state
        b = biased.model.language_model(input_ids=ids).last_hidden_state
    assert torch.equal(a, b)


def test_bad_requests_fail_with_the_fix():
    with pytest.raises(ValueError, match="attention_bias"):
        install_recency_prior(build_model(PhotosSpec(), seed=0, tower=False), 2, 1.0)
    with pytest.raises(ValueError, match=r"layers must be in \[0, 6\]"):
        install_recency_prior(_model(0, 0.0), 7, 1.0)
