"""The bundled SymbolGrid LVLM: loads offline, answers held-out questions whose answers live in
single vision tokens, keeps answering under LightKV at about 55% kept, and gives the quality
benchmark its teeth (random merging at 40% kept measurably loses detail answers)."""

from __future__ import annotations

import pytest
import torch

from lightkv.bench.quality import method_pipeline
from lightkv.digitgrid import evaluate as ev
from lightkv.digitgrid import model as dg
from lightkv.digitgrid import scoring as sc
from lightkv.symbolgrid import data as sg

# Floors well under what the shipped model measures (benchmarks/results/quality-symbolgrid.md),
# so that only a real regression (adapters, policies, data, weights) trips them.
UNCOMPRESSED_FLOOR = 0.9
LIGHTKV_FLOOR = 0.8
TEETH = 0.1  # random merging at 40% kept loses at least this much detail accuracy


@pytest.fixture(scope="module")
def bundled():
    return dg.load("symbolgrid")


@pytest.fixture(scope="module")
def convs(bundled):
    _, _, grid = bundled
    return sc.conversations(64, grid, seed=11)  # 16 per question type, each with a follow-up


@pytest.fixture(scope="module")
def uncompressed(bundled, convs):
    model, _, grid = bundled
    return sc.score(model, convs, grid, None, batch=32)


def test_bundled_model_is_a_small_offline_llava(monkeypatch):
    from transformers import LlavaForConditionalGeneration

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, _, grid = dg.load(dg.BUNDLED_MODELS["symbolgrid"])
    assert isinstance(model, LlavaForConditionalGeneration)
    assert model.config.text_config.num_hidden_layers >= 8
    assert isinstance(grid, sg.GridConfig)
    assert sg.num_image_tokens(grid, model.config.vision_config.patch_size) == 256
    size = sum(f.stat().st_size for f in dg.BUNDLED_MODELS["symbolgrid"].iterdir())
    assert size <= 20 * 2**20
    assert dg.read_task("symbolgrid").name == "symbolgrid"


def test_processor_builds_the_training_format(bundled):
    model, processor, grid = bundled
    ep = ev.heldout_episodes(1, seed=3, grid=grid)[0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " ".join(ep.question)}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(images=sg.to_pil(ep.image), text=text, return_tensors="pt")
    expected = sg.collate_prompts([ep], 256)
    assert torch.equal(inputs["input_ids"], expected["input_ids"])
    assert torch.allclose(inputs["pixel_values"], expected["pixel_values"], atol=1 / 255)


def test_uncompressed_accuracy_floor(bundled, convs, uncompressed):
    acc = uncompressed.accuracy()
    assert min(acc.values()) >= UNCOMPRESSED_FLOOR, acc
    # greedy generation agrees with the forced scoring, multi-token reads included
    model, _, grid = bundled
    firsts = [c.first for c in convs[:16]]
    gen = ev.evaluate(model, firsts, grid, None, batch=16)
    assert [a == e.answer for a, e in zip(gen.answers, firsts)] == uncompressed.correct[:16].tolist()


def test_identity_pipeline_has_zero_kl(bundled, convs, uncompressed):
    model, _, grid = bundled
    again = sc.score(model, convs, grid, None, batch=32)
    zero = torch.zeros(len(convs), dtype=torch.float64)
    assert torch.equal(sc.kl(uncompressed, again), zero)
    assert torch.equal(sc.kl(uncompressed, again, followup=True), zero)


def test_lightkv_at_55_percent_keeps_answering(bundled, convs, uncompressed):
    model, _, grid = bundled
    pipe, _ = method_pipeline("lightkv", model.config.text_config.num_hidden_layers, 0.55)
    res = sc.score(model, convs, grid, pipe, batch=32)
    assert 0.5 <= res.kept_fraction <= 0.6
    acc = res.accuracy()
    assert min(acc.values()) >= LIGHTKV_FLOOR, acc


def test_random_merging_at_40_percent_loses_detail_answers(bundled, convs, uncompressed):
    """The benchmark's teeth: random merge partners (lightkv's schedule, content-blind
    pairs) lose answers that need one token's content, measurably (paired bootstrap)."""
    from dataclasses import replace

    from lightkv.policies import EdgeScorer

    model, _, grid = bundled
    pipe, _ = method_pipeline("lightkv", model.config.text_config.num_hidden_layers, 0.40)
    pipe = replace(pipe, scorer=EdgeScorer.create("random"))
    res = sc.score(model, convs, grid, pipe, batch=32)
    detail = torch.tensor([q in sg.DETAIL_QTYPES for q in res.qtypes])
    diff, low, _ = sc.paired_bootstrap(uncompressed.correct[detail].double(), res.correct[detail].double())
    assert diff >= TEETH and low > 0, (diff, low, res.accuracy())
