"""One pass from YAML to Pipeline (issue 25 item 2) and the renamed keys (item 3).

Every value is validated once and every policy and scheduler constructed once; a scheduler
class declares its own YAML shorthand; a pipeline's text survives ``to_yaml(load(f))``;
renamed keys are refused (tests/test_removed_names.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

import lightkv
import lightkv.config
from lightkv.config import PipelineConfig, PolicySpec, json_schema
from lightkv.policies import (
    EdgeScorer,
    KeptFractionSchedule,
    Scheduler,
    StageSpec,
)
from lightkv.policies.scorers import CosineDivergence

PRESET_DIR = Path(lightkv.__file__).parent / "methods"
BUILT: dict[str, int] = {}


@dataclass
class CountingScorer(CosineDivergence):
    """Cosine that counts its constructions."""

    def __post_init__(self) -> None:
        BUILT["scorer"] = BUILT.get("scorer", 0) + 1


@dataclass
class EveryK(Scheduler):
    """A stage every ``every`` layers: a plugin scheduler with its own shorthand."""

    every: int = 4
    removal_ratio: float = 0.25

    shorthand: ClassVar[str] = "every"
    shorthand_keys: ClassVar[tuple[str, ...]] = ("removal_ratio",)

    def __post_init__(self) -> None:
        BUILT["scheduler"] = BUILT.get("scheduler", 0) + 1
        if self.every < 1:
            raise ValueError("every must be >= 1")

    def plan(self, num_layers):
        at = range(self.every - 1, num_layers - 1, self.every)
        return self._validate(
            [StageSpec(layer, self.removal_ratio, windows_per_side=1) for layer in at], num_layers
        )


@pytest.fixture
def plugins():
    """The two test policies, registered for one test only (the registries are global)."""
    BUILT.clear()
    EdgeScorer.register("counting_cosine")(CountingScorer)
    Scheduler.register("every_k")(EveryK)
    yield
    EdgeScorer._registry.pop("counting_cosine")
    Scheduler._registry.pop("every_k")


YAML = """name: counted
schedule:
  every: 3
scorer: {name: counting_cosine, params: {eps: 1.0e-09}}
stage_overrides:
  1:
    scorer: counting_cosine
"""


def test_each_policy_and_scheduler_is_constructed_once_from_yaml_to_pipeline(plugins):
    pipe = PipelineConfig.from_yaml_text(YAML).build()
    # one top-level scorer, one override scorer, one scheduler: each built once
    assert BUILT == {"scorer": 2, "scheduler": 1}
    assert isinstance(pipe.scheduler, EveryK) and pipe.scheduler.every == 3
    assert pipe.scorer.eps == 1e-9 and isinstance(pipe.stage_overrides[1]["scorer"], CountingScorer)
    assert [s.layer for s in pipe.scheduler.plan(12)] == [2, 5, 8]


def test_build_copies_without_constructing_again_and_edits_are_validated_again(plugins):
    cfg = PipelineConfig.from_yaml_text(YAML)
    a, b = cfg.build(), cfg.build()
    assert BUILT == {"scorer": 2, "scheduler": 1}
    assert a == b and a.scorer is not b.scorer and a.scheduler is not b.scheduler
    a.scorer.eps = 0.5  # a pipeline's policies are its own
    assert cfg.build().scorer.eps == 1e-9
    cfg.scorer = PolicySpec(
        name="counting_cosine", params={"eps": 0.25}
    )  # not validated on assignment
    assert (
        cfg.build().scorer.eps == 0.25 and BUILT["scorer"] == 4
    )  # the edited config, validated as a whole
    cfg.scorer = PolicySpec(name="counting_cosine", params={"eps": "big"})
    with pytest.raises(lightkv.config.ConfigError, match="scorer.params.eps"):
        cfg.build()


def test_kept_fraction_shorthand_constructs_its_scheduler_once(monkeypatch):
    calls = []
    check = KeptFractionSchedule.__post_init__
    monkeypatch.setattr(
        KeptFractionSchedule, "__post_init__", lambda self: (calls.append(1), check(self))[1]
    )
    cfg = PipelineConfig.from_yaml_text("schedule:\n  kept_fraction: 0.55\n")
    pipe = cfg.build()
    cfg.to_yaml()
    cfg.validate_for_model(32)
    assert len(calls) == 1 and pipe.scheduler.kept_fraction == 0.55


def test_a_plugin_scheduler_has_its_own_shorthand(plugins):
    cfg = PipelineConfig.from_yaml_text("schedule:\n  every: 5\n  removal_ratio: 0.5\n")
    assert cfg.schedule.model_dump() == {
        "name": "every_k",
        "params": {"every": 5, "removal_ratio": 0.5},
    }
    assert cfg.schedule.to_yaml_value() == {"every": 5, "removal_ratio": 0.5}
    assert PipelineConfig.from_yaml_text(cfg.to_yaml()) == cfg
    assert cfg == PipelineConfig.from_dict(
        {"schedule": {"name": "every_k", "params": {"every": 5, "removal_ratio": 0.5}}}
    )
    forms = json_schema()["$defs"]["ScheduleConfig"]["anyOf"]
    assert any(f.get("required") == ["every"] for f in forms)
    with pytest.raises(lightkv.config.ConfigError, match="schedule: every must be >= 1"):
        PipelineConfig.from_dict({"schedule": {"every": 0}})
    with pytest.raises(lightkv.config.ConfigError, match="give exactly one of .*every"):
        PipelineConfig.from_dict({"schedule": {"every": 2, "layers": [1]}})


@pytest.mark.parametrize("path", sorted(PRESET_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_to_yaml_of_a_loaded_file_is_the_file(path):
    text = path.read_text(encoding="utf-8")
    assert (
        lightkv.to_yaml(lightkv.load(str(path))) == text
    )  # summary, description and source included
    assert (
        lightkv.config.PipelineConfig.from_yaml_text(text).to_yaml() == text
    )  # presets stay canonical


def test_what_to_yaml_writes_loads_back_even_where_a_shorthand_cannot_say_it(tmp_path):
    """Regression: an empty explicit schedule (the identity pipeline lmms-eval's test writes)
    was written as the ``layers: []`` shorthand, which loading refuses."""
    from lightkv.policies.schedulers import ExplicitSchedule

    pipes = [
        lightkv.load(name).with_scheduler(
            ExplicitSchedule(layers=(), removal_ratios=(), windows_per_side=None)
        )
        for name in ("lightkv", "tome")
    ] + [lightkv.load(name) for name in lightkv.PRESETS]
    for i, pipe in enumerate(pipes):
        path = tmp_path / f"p{i}.yaml"
        lightkv.to_yaml(pipe, path)
        back = lightkv.load(str(path))
        assert back.scheduler == pipe.scheduler and lightkv.to_yaml(back) == path.read_text(
            encoding="utf-8"
        )


# renamed keys: tests/test_removed_names.py (refused, naming the new key)
