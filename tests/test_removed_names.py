"""Renamed names are gone (issue 40 item 1, issue 37 item 5).

An old name used to be read as an alias with a `DeprecationWarning` the CLI never showed,
and where a schedule named the old key and its new one the old value silently won. Now an
old YAML key, Python keyword or CLI flag is one error line naming the replacement.
"""

from __future__ import annotations

import pytest

from lightkv.cli import main
from lightkv.config import ConfigError, PipelineConfig
from lightkv.policies import (
    ExplicitSchedule,
    KeptFractionSchedule,
    Scheduler,
    StageInputs,
    StageSpec,
)
from lightkv.policies.schedulers import BudgetSchedule, PreLLMSchedule


@pytest.mark.parametrize(
    "yaml_text, old, new",
    [
        ("schedule:\n  layers: [2]\n  ratios: [0.5]\n", "ratios", "removal_ratios"),
        (
            "schedule:\n  layers: [2]\n  ratios: [0.5]\n  removal_ratios: [0.3]\n",
            "ratios",
            "removal_ratios",
        ),
        ("schedule:\n  kept_fraction: 0.5\n  max_ratio: 0.75\n", "max_ratio", "max_removal_ratio"),
        ("schedule: {target: 0.4}\n", "target", "kept_fraction"),
        ("schedule: {name: kept_fraction, params: {target: 0.4}}\n", "target", "kept_fraction"),
        (
            "schedule: {name: budget, params: {target: 0.4, kept_fraction: 0.3}}\n",
            "target",
            "kept_fraction",
        ),
        (
            "schedule: {name: pre_llm, params: {ratio: 0.5, removal_ratio: 0.3}}\n",
            "ratio",
            "removal_ratio",
        ),
        ("schedule: {name: cache, params: {ratio: 0.5}}\n", "ratio", "removal_ratio"),
        (
            "schedule: {name: scaled, params: {ratios: [0.5, 0.5, 0.5]}}\n",
            "ratios",
            "removal_ratios",
        ),
    ],
)
def test_an_old_yaml_key_is_one_error_naming_the_new_one(yaml_text, old, new):
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_yaml_text("name: x\n" + yaml_text)
    message = str(info.value)
    assert len(message.splitlines()) == 1, message
    assert f"'{old}' was renamed; use '{new}'" in message


@pytest.mark.parametrize(
    "build, old",
    [
        (lambda: ExplicitSchedule(layers=(2,), ratios=(0.3,)), "ratios"),
        (lambda: KeptFractionSchedule(target=0.4), "target"),
        (lambda: KeptFractionSchedule(kept_fraction=0.4, max_ratio=0.6), "max_ratio"),
        (lambda: BudgetSchedule(target=0.4), "target"),
        (lambda: PreLLMSchedule(ratio=0.5, removal_ratio=0.3), "ratio"),
        (lambda: StageSpec(3, 0.5, ratio=0.25), "ratio"),
        (lambda: StageSpec(0, 0.5, before=True), "before"),
        (lambda: StageSpec(0, 0.5, cache=True), "cache"),
        (lambda: Scheduler.create("explicit", layers=(2,), ratios=(0.3,)), "ratios"),
    ],
)
def test_an_old_python_keyword_is_refused_naming_the_new_one(build, old):
    with pytest.raises((TypeError, ValueError), match=f"'{old}' was renamed; use "):
        build()


def test_stage_spec_modes_and_no_old_attributes():
    spec = StageSpec(0, 0.5, windows_per_side=1, mode="pre_llm")
    assert spec.mode == "pre_llm" and StageSpec(1, 0.5, windows_per_side=1).mode == "layer"
    for old in ("ratio", "before", "cache"):
        assert not hasattr(spec, old)
    assert not hasattr(
        ExplicitSchedule(layers=(2,), removal_ratios=(0.3,), windows_per_side=(1,)), "ratios"
    )


def test_stage_inputs_of_refuses_ratio():
    from lightkv import ImageSegment, VisionLayout

    layout = VisionLayout.from_segments(1, 6, [ImageSegment(row=0, offset=1, grid=(2, 2))])
    with pytest.raises(TypeError, match="'ratio' was renamed; use 'removal_ratio'"):
        StageInputs.of(layout, windows_per_side=1, ratio=0.5)


@pytest.mark.parametrize(
    "argv, old, new",
    [
        (["bench", "quality", "--targets", "0.5"], "--targets", "--kept-fractions"),
        (
            ["bench", "quality", "--ablation-targets", "0.5"],
            "--ablation-targets",
            "--ablation-kept-fractions",
        ),
        (["bench", "efficiency", "--quick", "--budgets", "0.5"], "--budgets", "--kept-fractions"),
        (["bench", "ablation", "--targets", "0.5"], "--targets", "--kept-fractions"),
    ],
)
def test_an_old_flag_is_one_line_naming_the_new_one(argv, old, new, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"lightkv: error: {old} was renamed; use {new}"


def test_an_old_yaml_key_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text("name: old\nschedule: {layers: [1], ratios: [0.5], removal_ratios: [0.3]}\n")
    assert main(["config", "validate", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'ratios' was renamed; use 'removal_ratios'" in err[0]


@pytest.mark.parametrize(
    "policy", ["scorer: {name: cosine, params: {features: keys}}", "pruner: {name: dart}"]
)
def test_the_key_states_feature_has_one_name(policy):
    """Issue 48 item 5: ``keys`` named two tensors; the stage's per-token keys are
    ``key_states`` (a feature value, `StageInputs.key_states`, ``Stage(key_states=...)``),
    and the old value is refused naming the new one. DART's default reads them."""
    from lightkv.policies import Pruner, StageInputs
    from lightkv.policies.inputs import FEATURES

    assert FEATURES == ("hidden", "key_states") and "key_states" in StageInputs.__dataclass_fields__
    assert "keys" not in StageInputs.__dataclass_fields__
    if "dart" in policy:
        assert Pruner.create("dart").needs == {"key_states"}
        return
    with pytest.raises(ConfigError, match="Input should be 'hidden' or 'key_states', got 'keys'"):
        PipelineConfig.from_yaml_text(policy)
