"""Regressions (issue 27, items 2 and 3): a deep copy of the model made inside a session runs
uncompressed, and another thread's call on a model with an open session is refused instead
of being compressed and counted in that session's report."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

from lightkv.adapters import apply

from .conftest import get_model, tiny_lightkv


def _batch():
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    return model, fam.collate(fam.examples(model)[:1])


def test_a_deep_copy_made_inside_a_session_is_not_compressed():
    model, batch = _batch()
    ref = model(**batch).logits
    with apply(tiny_lightkv(), model) as session:
        clone = copy.deepcopy(model)
        inside = clone(**batch).logits
        compressed = model(**batch).logits
        forwards = session.num_forwards
    after = clone(**batch).logits
    assert compressed.shape[1] < ref.shape[1]  # the session's own model is compressed
    assert forwards == 1  # the copy's forward was not the session's
    assert inside.shape == ref.shape and torch.equal(inside, ref)
    assert torch.equal(after, ref)
    with apply(tiny_lightkv(), clone):  # the copy takes a session of its own
        assert clone(**batch).logits.shape == compressed.shape


def test_another_threads_call_is_refused_while_a_session_is_open():
    model, batch = _batch()
    ref = model(**batch).logits
    errors, outputs = [], []

    def call():
        try:
            outputs.append(model(**batch).logits)
        except RuntimeError as e:
            errors.append(str(e))

    with apply(tiny_lightkv(), model) as session:
        worker = threading.Thread(target=call)
        worker.start()
        worker.join()
        assert session.num_forwards == 0 and session.last_prefill is None  # nothing counted
        mine = model(**batch).logits  # the owning thread still compresses
    assert len(errors) == 1 and not outputs
    assert "session open in another thread" in errors[0] and "after its `with` block" in errors[0]
    assert mine.shape[1] < ref.shape[1]
    worker = threading.Thread(target=call)  # after the block: a plain call from any thread
    worker.start()
    worker.join()
    assert len(outputs) == 1 and torch.equal(outputs[0], ref)


def test_a_session_entered_in_a_worker_thread_compresses_there():
    model, batch = _batch()
    shapes = []

    def work():
        with apply(tiny_lightkv(), model) as session:
            shapes.append(model(**batch).logits.shape[1])
            shapes.append(session.report().kept_vision_fraction)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert shapes[0] < batch["input_ids"].shape[1] and shapes[1] < 1.0
    with pytest.raises(
        RuntimeError, match="no prefill"
    ):  # nothing leaked into a later session here
        with apply(tiny_lightkv(), model) as session:
            session.to_prompt_positions(torch.zeros(1, 1))
