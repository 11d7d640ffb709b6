"""The bundled SymbolGrid LVLM: loads offline, answers held-out questions whose answers sit in
single vision tokens, keeps answering under LightKV at about 55% of the vision KV cache, and
gives the quality benchmark its teeth (random merging at 40% kept loses detail answers)."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.tasks import evaluate as ev
from lightkv_lab.tasks import model as dg
from lightkv_lab.tasks import scoring as sc

# Floors well under what the shipped model measures (benchmarks/results/quality-symbolgrid.md),
# so that only a real regression (adapters, policies, data, weights) trips them.
UNCOMPRESSED_FLOOR = 0.9
LIGHTKV_FLOOR = {"what": 0.15, "exists": 0.5}
"""Low on purpose: on this model every merging method loses most single-token answers at 55%
(measured: lightkv what 0.27-0.44, read 0.0, exists 0.66); the floor guards against worse."""
TEETH = 0.1
"""Random merging at 40% kept must lose at least this much accuracy on a detail question type."""


@pytest.fixture(scope="module")
def bundled():
    return dg.load("symbolgrid")


@pytest.fixture(scope="module")
def episodes(bundled):
    _, _, grid = bundled
    return ev.heldout_episodes(48, seed=11, grid=grid)  # 16 per asked question type


def test_bundled_model_is_a_small_offline_llava(monkeypatch, bundled):
    from transformers import LlavaForConditionalGeneration

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = dg.resolve_model("symbolgrid")
    model, _, grid = dg.load(path)
    assert isinstance(model, LlavaForConditionalGeneration)
    assert dg.read_task(path).name == "symbolgrid"
    assert model.config.text_config.num_hidden_layers >= 8
    patch = model.config.vision_config.patch_size
    assert patch == grid.cell and (grid.image_size // patch) ** 2 == 256  # one token per symbol
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= 20 * 2**20
    for name in ("config.json", "model.safetensors", "tokenizer.json", "processor_config.json"):
        assert (path / name).exists(), name


def test_uncompressed_accuracy_floor(bundled, episodes):
    model, _, grid = bundled
    res = ev.evaluate(model, episodes, grid, None, batch=48)
    assert res.kept_fraction == 1.0
    assert set(res.accuracy) == {
        "what",
        "read",
        "exists",
    }  # the shipped model is not asked to count
    assert min(res.accuracy.values()) >= UNCOMPRESSED_FLOOR, res.accuracy


def test_lightkv_at_55_percent_keeps_answering(bundled, episodes):
    model, _, grid = bundled
    pipe, _ = knob_pipeline("lightkv", model.config.text_config.num_hidden_layers, 0.55)
    res = ev.evaluate(model, episodes, grid, pipe, batch=48)
    assert 0.5 <= res.kept_fraction <= 0.6
    assert res.kv_bytes_vision < 0.62 * res.kv_bytes_vision_baseline
    assert all(res.accuracy[q] >= floor for q, floor in LIGHTKV_FLOOR.items()), res.accuracy


def test_random_merging_at_40_percent_loses_detail_answers(bundled):
    """The benchmark's teeth: merging partners chosen at random destroy single-token answers."""
    model, _, grid = bundled
    eps = [e for e in ev.heldout_episodes(60, seed=12, grid=grid) if e.qtype in ("what", "read")][
        :40
    ]
    base = ev.evaluate(model, eps, grid, None, batch=64)
    pipe, _ = knob_pipeline("random", model.config.text_config.num_hidden_layers, 0.40)
    res = ev.evaluate(model, eps, grid, pipe, batch=64)
    assert 0.35 <= res.kept_fraction <= 0.45
    losses = {q: base.accuracy[q] - res.accuracy[q] for q in base.accuracy}
    assert max(losses.values()) >= TEETH, (base.accuracy, res.accuracy)


def test_identity_pipeline_has_zero_kl(bundled):
    model, _, grid = bundled
    convs = sc.conversations(8, grid, seed=5, followup=True)
    base = sc.score(model, convs, grid, None, batch=8)
    same = sc.score(model, convs, grid, ev._identity_pipeline(), batch=8)
    assert torch.equal(sc.kl(base, same), torch.zeros_like(sc.kl(base, same)))
    assert torch.equal(base.logp, same.logp)
