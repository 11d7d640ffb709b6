"""The bundled DigitGrid LVLM: loads offline, answers held-out questions, keeps answering
under LightKV at about 55% of the vision KV cache; the demo and `lightkv generate` use it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sklearn")

from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.tasks import evaluate as ev
from lightkv_lab.tasks import model as dg

import lightkv

# Floors well under what the shipped model measures (see benchmarks/results/quality.md),
# so that only a real regression (adapters, policies, data, weights) trips them.
UNCOMPRESSED_FLOOR = 0.9
LIGHTKV_FLOOR = 0.85


@pytest.fixture(scope="module")
def bundled():
    return dg.load()


@pytest.fixture(scope="module")
def episodes(bundled):
    _, _, grid = bundled
    return ev.heldout_episodes(96, seed=11, grid=grid)  # 24 per question type


def test_bundled_model_is_a_small_offline_llava(monkeypatch, bundled):
    from transformers import LlavaForConditionalGeneration

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, _, grid = dg.load()  # from the package directory, no network
    assert isinstance(model, LlavaForConditionalGeneration)
    assert model.config.text_config.num_hidden_layers >= 6
    patch = model.config.vision_config.patch_size
    assert (grid.image_size // patch) ** 2 >= 256
    size = sum(f.stat().st_size for f in dg.BUNDLED_MODEL.iterdir())
    assert size <= 20 * 2**20
    for name in ("config.json", "model.safetensors", "tokenizer.json", "processor_config.json"):
        assert (dg.BUNDLED_MODEL / name).exists(), name


def test_processor_builds_the_training_format(bundled):
    from lightkv_lab.tasks.digitgrid import data

    model, processor, grid = bundled
    ep = ev.heldout_episodes(1, seed=3, grid=grid)[0]
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": " ".join(ep.question)}],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(images=data.to_pil(ep.image), text=text, return_tensors="pt")
    expected = data.collate_prompts(
        [ep], data.num_image_tokens(grid, model.config.vision_config.patch_size)
    )
    assert torch.equal(inputs["input_ids"], expected["input_ids"])
    # 8-bit quantisation of the image is the only difference from the training tensors
    assert torch.allclose(inputs["pixel_values"], expected["pixel_values"], atol=1 / 255)


def test_uncompressed_accuracy_floor(bundled, episodes):
    model, _, grid = bundled
    res = ev.evaluate(model, episodes, grid, None, batch=48)
    assert res.kept_fraction == 1.0
    assert min(res.accuracy.values()) >= UNCOMPRESSED_FLOOR, res.accuracy


def test_lightkv_at_55_percent_keeps_answering(bundled, episodes):
    model, _, grid = bundled
    pipe, how = knob_pipeline("lightkv", model.config.text_config.num_hidden_layers, 0.55)
    assert how == "scaled" and pipe.scheduler.removal_ratios == (
        0.5,
    )  # LightKV's own ratio at its scaled layers
    res = ev.evaluate(model, episodes, grid, pipe, batch=48)
    assert 0.5 <= res.kept_fraction <= 0.6
    assert res.kv_bytes_vision < 0.62 * res.kv_bytes_vision_baseline
    assert res.overall >= LIGHTKV_FLOOR, res.accuracy
    assert min(res.accuracy.values()) >= LIGHTKV_FLOOR - 0.1, res.accuracy


def test_empty_schedule_reproduces_uncompressed_answers(bundled, episodes):
    model, _, grid = bundled
    base = ev.evaluate(model, episodes[:32], grid, None)
    budget = lightkv.load("lightkv-budget")
    from dataclasses import replace

    from lightkv.policies.schedulers import KeptFractionSchedule

    full = ev.evaluate(
        model,
        episodes[:32],
        grid,
        replace(budget, scheduler=KeptFractionSchedule(kept_fraction=1.0)),
    )
    assert full.answers == base.answers
    assert full.kept_fraction == 1.0


def test_relevance_mass_is_reported(bundled, episodes):
    model, _, grid = bundled
    out = ev.relevance_mass(model, episodes, grid, layers=[1])
    assert out["episodes"] > 0 and out["area_share"] == 1 / 16
    for policy in ("query_softmax", "last_token"):
        share = out["layers"]["1"][policy]
        assert 0.0 <= share["asked"] <= 1.0 and 0.0 <= share["control"] <= 1.0


def test_demo_runs_end_to_end(tmp_path, capsys):
    from lightkv.cli import main

    assert main(["demo", "--questions", "4", "--contrast", "8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "correct:" in out and "lightkv-budget" in out
    # every method at 55% and at the low budget, on the same stated questions
    for target in ("55%", "25%"):
        at = f"at {target} of the vision KV cache, right out of 8 held-out questions (kept"
        assert at in out
        rows = out.split(at)[1].splitlines()[1:3]
        assert rows[0].split()[0] == "lightkv" and rows[1].split()[0] == "lightkv-cover"
    assert (tmp_path / "lightkv-demo-provenance.png").stat().st_size > 0


def test_demo_checks_its_optional_dependencies_before_any_output(tmp_path, capsys, monkeypatch):
    import importlib.util

    from lightkv_lab.demos.bundled import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    assert main(["--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert (
        captured.out == ""
        and "pip install matplotlib" in captured.err
        and "--no-png" in captured.err
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--questions", "1000000"],
        ["--contrast", "10000000"],
        ["--low", "0"],
        ["--low", "1.5"],
        ["--questions", "0"],
    ],
)
def test_demo_refuses_values_past_its_limits_up_front(argv, capsys):
    from lightkv_lab.demos.bundled import main

    assert main([*argv, "--no-png"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "lightkv demo:" in captured.err


def test_demo_refuses_a_file_as_out_before_any_output(tmp_path, capsys):
    from lightkv_lab.demos.bundled import main

    target = tmp_path / "taken"
    target.write_text("x")
    assert main(["--out", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"--out {target}: not a directory" in captured.err


def test_demo_rejects_a_model_that_is_not_there(tmp_path, capsys):
    from lightkv_lab.demos.bundled import main

    assert main(["--model", str(tmp_path / "nope"), "--no-png"]) == 2
    assert "cannot load the model" in capsys.readouterr().err


def test_generate_defaults_to_the_bundled_model(capsys):
    from lightkv.cli import main

    assert main(["generate", "--max-new-tokens", "3", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "expected answer" in out and "answer (lightkv)" in out
    expected = out.split("expected answer: ", 1)[1].split(")", 1)[0].strip("'")
    assert f"answer (baseline): {expected!r}" in out


def test_generate_json_on_the_bundled_model_prints_one_json_document(capsys):
    """Issue 27, item 11: with the bundled model's default image and prompt, stdout is
    exactly one JSON object (the example's image, prompt and expected answer inside it)."""
    import json

    from lightkv.cli import main

    assert main(["generate", "--max-new-tokens", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["example"]["prompt"] and doc["example"]["expected_answer"]


def test_demo_refuses_an_unwritable_out_before_any_output(tmp_path, capsys):
    """Issue 27, item 7: an --out the demo cannot write into is refused up front (a file in
    the way of the directory, here), not after the run."""
    from lightkv_lab.demos.bundled import main

    (tmp_path / "file").write_text("x")
    assert main(["--out", str(tmp_path / "file" / "sub")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "cannot write there (Not a directory)" in captured.err
