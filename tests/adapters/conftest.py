"""Shared fixtures: tiny random models of every supported family (built once per run)."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv import Pipeline
from lightkv.policies import ExplicitSchedule

FAMILY_NAMES = list(TINY_MODELS)

_MODELS: dict = {}


def get_model(family: str, attn: str = "sdpa", dtype: torch.dtype = torch.float32):
    key = (family, attn, dtype)
    if key not in _MODELS:
        _MODELS[key] = TINY_MODELS[family].build(attn_implementation=attn, dtype=dtype)
    return _MODELS[key]


def decoder_layers(model):
    """The model's decoder layers, found as the session finds them (the adapter's lookup)."""
    from lightkv.adapters import get_adapter

    return get_adapter(model).decoder_layers()


def identity_pipeline() -> Pipeline:
    """Two scheduled stages that remove nothing: every hook path runs, nothing changes."""
    return Pipeline(
        scheduler=ExplicitSchedule(layers=(1, 2), windows_per_side=(2, 1), removal_ratios=(0.0,)),
        name="identity",
    )


def tiny_lightkv() -> Pipeline:
    """The LightKV preset's policies on a 4-layer schedule: half of each 2x2-window, then global."""
    pipe = lightkv.load("lightkv")
    return pipe.with_scheduler(
        ExplicitSchedule(layers=(1, 2), windows_per_side=(2, 1), removal_ratios=(0.5,))
    )


@pytest.fixture(params=FAMILY_NAMES)
def family(request):
    return request.param


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def assert_rows_match_batch(
    model, fam, batch, rows, gen: dict, together=None, atol: float = 1e-4
) -> None:
    """Every row generated alone equals the same row of the left-padded batch: the same new
    tokens (a row alone may stop earlier at EOS) and logits within ``atol``. Runs inside the
    caller's session; ``together`` is the batch's ``generate`` output when already made."""
    together = model.generate(**batch, **gen) if together is None else together
    for i, row in enumerate(rows):
        single = fam.collate([row])
        alone = model.generate(**single, **gen)
        new = alone.sequences[0, single["input_ids"].shape[1] :]  # shorter when it ended with EOS
        assert torch.equal(new, together.sequences[i, batch["input_ids"].shape[1] :][: new.numel()])
        for a, b in zip(alone.logits, together.logits):
            assert (a[0] - b[i]).abs().max().item() <= atol
