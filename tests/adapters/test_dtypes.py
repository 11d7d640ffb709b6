"""Half precision on CPU: run where torch supports it, skip with the reason otherwise."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply

from .conftest import get_model, identity_pipeline, tiny_lightkv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision(family, dtype):
    fam = TINY_MODELS[family]
    model = get_model(family, "sdpa", dtype)
    batch = fam.collate(fam.examples(model))
    batch = {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in batch.items()}
    try:
        ref = model.generate(
            **batch,
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    except (
        RuntimeError,
        NotImplementedError,
    ) as err:  # pragma: no cover - depends on the torch build
        if "not implemented" not in str(err).lower():
            raise
        pytest.skip(f"{dtype} inference is not supported on this CPU build: {err}")
    with apply(identity_pipeline(), model, **fam.adapter_options):
        same = model.generate(
            **batch,
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(same.sequences, ref.sequences)
    for a, b in zip(same.logits, ref.logits):
        assert (a.float() - b.float()).abs().max().item() <= 1e-2
    with apply(tiny_lightkv(), model, **fam.adapter_options) as session:
        out = model.generate(
            **batch,
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    assert all(torch.isfinite(x).all() for x in out.logits)
    fp32 = get_model(family)
    with apply(tiny_lightkv(), fp32, **fam.adapter_options) as session32:
        fp32(**fam.collate(fam.examples(fp32)))
    # same token counts per layer as in fp32 (the schedule does not depend on precision)
    assert [l.tokens for l in session.report().layers] == [
        l.tokens for l in session32.report().layers
    ]
