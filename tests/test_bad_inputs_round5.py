"""The fifth round of bad inputs (issue 52 item 10): each repro from the issue, fixed; the
same refusal from ``config validate`` as from ``lightkv.apply``, every bad field of one
params block reported, a directory named as one, ``--max-new-tokens`` capped, a dry run
that misses its target headlined, and a two-episode quality run that writes its files."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.cli import main
from lightkv.config import ConfigError, PipelineConfig
from lightkv.presets import get_preset_config

CACHE_REFUSED = ("lightkv-cover", "visionzip", "vispruner", "scope", "holov")


def _err(capsys) -> list[str]:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and not any("Traceback" in line for line in err), err
    return err


def _at_cache(name: str, tmp_path) -> str:
    """The issue's repro: ``config show NAME > c.yaml; echo 'placement: cache' >> c.yaml``."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(get_preset_config(name).to_yaml() + "placement: cache\n")
    return str(path)


@pytest.fixture(scope="module")
def llava():
    spec = TINY_MODELS["llava"]
    return spec.build(num_layers=8)


@pytest.mark.parametrize("name", CACHE_REFUSED)
def test_validate_refuses_a_cache_placement_with_the_message_apply_gives(
    name, tmp_path, capsys, llava
):
    path = _at_cache(name, tmp_path)
    assert main(["config", "validate", path, "--num-layers", "8"]) == 1
    (line,) = _err(capsys)
    cfg = PipelineConfig.from_yaml(path)
    with pytest.raises(ConfigError) as refused:
        cfg.validate_for_model(8)
    ((where, message),) = refused.value.problems
    assert where == "placement" and line == f"lightkv: error: {path}: placement: {message}"
    # apply, given the same pipeline without the config's check, refuses with the same words
    with pytest.raises(ValueError) as applied:
        with lightkv.apply(cfg.build(), llava):
            pass
    assert str(applied.value) == message
    assert "cannot compute relevance" in message and "placement: pre_llm or layer" in message


def test_a_planned_cache_stage_with_a_tower_relevance_is_located_at_its_relevance():
    cfg = PipelineConfig.from_dict(
        {
            "schedule": {"name": "cache", "params": {"layers": [1, 2], "removal_ratio": 0.5}},
            "relevance": "tower_attention",
        }
    )
    with pytest.raises(ConfigError) as e:
        cfg.validate_for_model(4)
    assert e.value.problems[0][0] == "relevance"
    assert "layer 1's cache cannot compute relevance 'tower_attention'" in str(e.value)


def test_every_bad_field_of_a_params_block_is_reported(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "schedule": {
                    "name": "explicit",
                    "params": {
                        "layers": [1.5, 2],
                        "windows_per_side": [2, "x"],
                        "removal_ratios": ["half"],
                    },
                }
            }
        )
    )
    assert main(["config", "validate", str(path)]) == 1
    lines = _err(capsys)
    where = [line.split(": ")[3] for line in lines]
    assert where == [
        "schedule.params.layers.0",
        "schedule.params.removal_ratios.0",
        "schedule.params.windows_per_side.1",
    ]
    assert "1.5" in lines[0] and "'half'" in lines[1] and "'x'" in lines[2]
    # the shorthand form, and a policy's params block, report every field too
    with pytest.raises(ConfigError) as e:
        PipelineConfig.from_dict(
            {"schedule": {"layers": [1.5, 2], "windows_per_side": [2, "x"], "removal_ratios": 0.5}}
        )
    assert [loc for loc, _ in e.value.problems] == [
        "schedule.layers.0",
        "schedule.windows_per_side.1",
    ]
    with pytest.raises(ConfigError) as e:
        PipelineConfig.from_dict(
            {"stage_overrides": {0: {"pruner": {"name": "random", "params": {"seed": "y"}}}}}
        )
    assert [loc for loc, _ in e.value.problems] == ["stage_overrides.0.pruner.params.seed"]


@pytest.mark.parametrize("form", ["{d}", "{d}/", "./{d}"])
def test_a_directory_is_named_as_a_directory(form, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    target = form.format(d="runs")
    assert main(["config", "validate", target]) == 2
    (line,) = _err(capsys)
    assert line == (
        f"lightkv: error: {target}: is a directory, not a file: give a pipeline YAML file in "
        "it, or a preset name (lightkv presets)"
    )
    with pytest.raises(FileNotFoundError, match="is a directory, not a file"):
        lightkv.load(target)


def test_a_directory_named_like_a_preset_does_not_hide_the_preset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fastv").mkdir()
    assert lightkv.load("fastv").name == "fastv"


def test_max_new_tokens_is_capped_before_any_work(capsys):
    from lightkv.cli.generate import MAX_NEW_TOKENS

    assert main(["generate", "--max-new-tokens", "99999999999"]) == 2
    line = _err(capsys)[-1]
    assert "--max-new-tokens: at most 32,768" in line and "99,999,999,999" in line
    assert MAX_NEW_TOKENS == 32_768


def _validate(capsys, *argv) -> list[str]:
    assert main(["config", "validate", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_validate_headlines_the_dry_runs_kept_fraction_when_it_misses(tmp_path, capsys):
    """``lightkv-paper`` before the LLM on an 8x8 grid keeps all 64 tokens: the headline said
    "kept 57.4%" above "64 -> 64"."""
    path = tmp_path / "paper.yaml"
    path.write_text(get_preset_config("lightkv-paper").to_yaml() + "placement: pre_llm\n")
    out = _validate(capsys, str(path), "--grid", "8x8", "--num-layers", "32")
    (head,) = [line for line in out if "kept on average" in line]
    assert head.strip() == (
        "vision KV kept on average over layers: 100.0% in the dry run "
        "(the schedule's ratios: 57.4%, target missed)"
    )
    assert any("64 -> 64 vision tokens" in line for line in out)
    assert any("stage 0 removed 0.0% of its 64 vision tokens, not 42.6%" in line for line in out)


def test_the_dry_run_flags_a_stage_that_cannot_reach_its_ratio(tmp_path, capsys):
    """A 0.75 stage with a parity split acts as 0.5 (issue 48 item 5)."""
    path = tmp_path / "three-quarters.yaml"
    path.write_text("schedule: {layers: [3], removal_ratios: 0.75, windows_per_side: 2}\n")
    out = _validate(capsys, str(path), "--num-layers", "8")
    assert any("576 -> 288 vision tokens" in line for line in out)
    flags = [line.strip() for line in out if "removed" in line]
    assert flags == [
        "stage 0 removed 50.0% of its 576 vision tokens, not 75.0%: its policies cannot remove "
        "that much here (a parity split removes at most half a window; a window too small to "
        "split keeps all)"
    ]
    # the plan's 0.75 after layer 3 of 8 would keep (4 + 4 x 0.25) / 8 = 62.5%; the dry run
    # keeps (4 + 4 x 0.5) / 8 = 75%
    (head,) = [line.strip() for line in out if "kept on average" in line]
    assert head.startswith("vision KV kept on average over layers: 75.0% in the dry run")
    assert "62.5%, target missed" in head


def test_a_dry_run_on_target_keeps_the_analytic_headline(capsys):
    out = _validate(capsys, "lightkv", "--num-layers", "32")
    assert "  vision KV kept on average over layers: 57.4%" in out
    assert not any("removed" in line for line in out)


def test_a_two_episode_quality_run_writes_its_json_and_markdown(tmp_path, capsys):
    """``bench quality --episodes 2 ...`` ended in ``KeyError: 'count'`` in the markdown table
    after the whole run, writing nothing: a question type it never drew shows as '-'."""
    out = tmp_path / "q2"
    argv = ["bench", "quality", "--episodes", "2", "--methods", "fastv", "--kept-fractions"]
    assert main([*argv, "0.5", "--no-ablations", "--out", str(out)]) == 0
    result = json.loads((out / "quality-scenes.json").read_text())
    md = (out / "quality-scenes.md").read_text()
    drawn = set(result["uncompressed"]["accuracy"]) - {"overall", "followup"}
    missing = [q for q in result["qtypes"] if q not in drawn]
    assert missing, "two conversations cannot draw all six question types"
    # no lightkv method among --methods and no --baseline: no intervals, and a note says why
    assert result["baseline"] is None and "no intervals: none of the methods" in md
    assert "()" not in md
    (row,) = [line for line in md.splitlines() if line.startswith("| fastv | 0.50 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    for i, q in enumerate(result["qtypes"]):
        assert (cells[3 + i] == "-") == (q in missing)


def test_the_quality_table_of_a_run_without_detail_questions():
    from lightkv_lab.bench.quality_report import accuracy_cell, detail_accuracy

    row = {"accuracy": {"texture": 1.0, "overall": 1.0}}
    result = {"detail_qtypes": ["count", "exists"]}
    assert math.isnan(detail_accuracy(row, result))
    assert accuracy_cell(row, "count") == "-" and accuracy_cell(row, "texture") == "1.000"
