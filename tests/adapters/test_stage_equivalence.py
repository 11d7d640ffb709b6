"""Inside the model, a stage is exactly the pure `Stage` on the captured hidden states:
the adapters add no arithmetic of their own."""

from __future__ import annotations

import torch
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply
from lightkv.adapters.masks import drop_padding

from .conftest import decoder_layers, get_model, tiny_lightkv


def test_merges_equal_pure_stage_on_captured_states(family):
    model = get_model(family)
    fam = TINY_MODELS[family]
    layers = decoder_layers(model)
    outputs, inputs = {}, {}
    hooks = []
    for i in (1, 2):
        hooks.append(
            layers[i].register_forward_hook(lambda m, a, o, i=i: outputs.__setitem__(i, o))
        )
        hooks.append(
            layers[i + 1].register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        )
    batch = fam.collate(fam.examples(model))
    try:
        with apply(tiny_lightkv(), model, record=True, **fam.adapter_options) as session:
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    assert [r.layer for r in session.records] == [1, 2]
    for record in session.records:
        i = record.layer
        assert torch.equal(record.hidden, outputs[i])  # the stage saw the layer's real output
        pure = record.stage(
            outputs[i], record.layout, record.relevance, record.provenance, record.key_states
        )
        # The adapter only drops padding columns (gathers); the surviving tokens are the
        # stage's own, bit for bit, and they are what the next layer receives.
        expected = drop_padding(pure)
        assert torch.equal(expected.hidden, inputs[i])
        assert torch.equal(expected.hidden, record.result.hidden)
        assert expected.layout == record.result.layout
        for b in range(pure.hidden.shape[0]):
            keep = pure.layout.valid_mask[b]
            got = record.result.layout.valid_mask[b]
            assert torch.equal(pure.hidden[b][keep], inputs[i][b][got])
