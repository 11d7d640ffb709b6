"""Relevance inside the model: computed from the layer's own projections, never from eager
attention, and equal to what eager attention weights give."""

from __future__ import annotations

import math

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv import Pipeline
from lightkv.adapters import apply
from lightkv.policies import ExplicitSchedule, QueryAxisSoftmax

from .conftest import decoder_layers, get_model


def _fastv(layer: int = 1) -> Pipeline:
    return lightkv.load("fastv").with_scheduler(
        ExplicitSchedule(layers=(layer,), windows_per_side=(1,), removal_ratios=(0.5,))
    )


def _kept_vision(record) -> list[list[int]]:
    layout = record.result.layout
    return [
        sorted(layout.origin[b][layout.vision_mask[b]].tolist()) for b in range(layout.batch_size)
    ]


def test_fastv_through_sdpa_equals_eager_attention_weights(family):
    """FastV top-k from our sdpa-side relevance keeps exactly the tokens that the last
    token's eager attention weights (averaged over heads) rank highest."""
    fam = TINY_MODELS[family]
    sdpa = get_model(family, "sdpa")
    eager = get_model(family, "eager")
    eager.load_state_dict(sdpa.state_dict())
    batch = fam.collate(fam.examples(sdpa))
    layer = 1
    with apply(_fastv(layer), sdpa, **fam.adapter_options) as session:
        sdpa(**batch)
    record = session.records[0]
    layout = record.layout if record.layout is not None else session.last_prefill.layout
    attn = eager(**batch, output_attentions=True).attentions[layer]  # [B, H, N, N]
    xi = attn[:, :, -1, :].float().mean(dim=1)  # the last column is every row's last token
    expected = []
    for b in range(xi.shape[0]):
        vis = layout.vision_mask[b].nonzero().squeeze(1)
        r = math.floor(0.5 * vis.numel())
        order = torch.sort(xi[b, vis], stable=True).indices
        expected.append(sorted(vis[order[r:]].tolist()))
    assert _kept_vision(record) == expected
    # the same pipeline on the eager model keeps the same tokens
    with apply(_fastv(layer), eager, **fam.adapter_options) as session_eager:
        eager(**batch)
    assert _kept_vision(session_eager.records[0]) == expected


def test_query_softmax_relevance_matches_captured_projections(family):
    """ξ (LightKV's relevance) equals the policy applied to the queries and keys the
    layer itself computes (captured from its projections)."""
    model = get_model(family)
    fam = TINY_MODELS[family]
    layer_idx = 1
    layer = decoder_layers(model)[layer_idx]
    attn = layer.self_attn
    if not hasattr(attn, "q_proj"):
        pytest.skip("fused-QKV attention: covered by the FastV comparison with eager weights")
    captured = {}
    module = __import__(type(attn).__module__, fromlist=["apply_rotary_pos_emb"])
    hooks = [
        attn.q_proj.register_forward_hook(lambda m, a, o: captured.__setitem__("q", o)),
        attn.k_proj.register_forward_hook(lambda m, a, o: captured.__setitem__("k", o)),
        attn.register_forward_pre_hook(
            lambda m, a, kw: captured.__setitem__("pos", kw["position_embeddings"]),
            with_kwargs=True,
        ),
    ]
    pipe = Pipeline(
        scheduler=ExplicitSchedule(
            layers=(layer_idx,), windows_per_side=(2,), removal_ratios=(0.5,)
        ),
        relevance=QueryAxisSoftmax(),
    )
    batch = fam.collate(fam.examples(model))
    try:
        with apply(pipe, model, record=True, **fam.adapter_options) as session:
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    b, n = captured["q"].shape[:2]
    d = attn.head_dim
    q, k = captured["q"].view(b, n, -1, d), captured["k"].view(b, n, -1, d)
    if hasattr(
        attn, "q_norm"
    ):  # per-head norms after the projections (Gemma 3, Qwen3), as the layer applies them
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = captured["pos"]
    q, k = module.apply_rotary_pos_emb(q, k, cos, sin)
    record = session.records[0]
    expected = QueryAxisSoftmax().score(q, k, record.layout)
    assert torch.allclose(record.relevance, expected, atol=1e-5, rtol=1e-4)
