"""The schedule in a config: one canonical form, the shorthands normalising to it, the depth-scaled
and budgeted schedulers from YAML, and round trips."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv.config import (
    ConfigError,
    PipelineConfig,
    ScheduleConfig,
    config_from_pipeline,
    json_schema,
)
from lightkv.policies import (
    BudgetSchedule,
    ExplicitSchedule,
    KeptFractionSchedule,
    ScaledSchedule,
    average_kept_fraction,
    budget_schedule,
    scale_layers,
)
from lightkv.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def _schedule(text: str) -> PipelineConfig:
    return PipelineConfig.from_yaml_text(f"name: s\nschedule:\n{text}")


def _problems(data) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_dict({"schedule": data})
    return dict(info.value.problems)


# ---------------------------------------------------------------------------- one canonical form
def test_the_kept_fraction_shorthand_is_the_registered_scheduler():
    forms = [
        {"kept_fraction": 0.55},
        {"name": "kept_fraction", "params": {"kept_fraction": 0.55}},
        {"name": "kept_fraction"},
        "kept_fraction",
    ]
    configs = [ScheduleConfig.model_validate(f) for f in forms]
    assert all(c == configs[0] for c in configs)
    assert configs[0].model_dump() == {
        "name": "kept_fraction",
        "params": {},
    }  # 0.55 is the default target
    assert {repr(c.build()) for c in configs} == {repr(KeptFractionSchedule())}
    assert configs[0].to_yaml_value() == {"kept_fraction": 0.55}


def test_the_layers_shorthand_is_the_explicit_scheduler():
    short = ScheduleConfig.model_validate({"layers": [1], "removal_ratios": 0.5})
    canonical = ScheduleConfig.model_validate(
        {"name": "explicit", "params": {"layers": [1], "windows_per_side": None}}
    )
    assert short == canonical and short.build() == canonical.build() == ExplicitSchedule(
        layers=(1,), windows_per_side=None
    )
    assert canonical.to_yaml_value() == {
        "layers": [1],
        "removal_ratios": [0.5],
    }  # written back in the short form
    # the registered form's own defaults: (4, 2, 1) windows unless told otherwise
    default = ScheduleConfig.model_validate({"name": "explicit"})
    assert default == ScheduleConfig.model_validate(
        {"layers": [12, 18, 24], "removal_ratios": [0.5], "windows_per_side": [4, 2, 1]}
    )
    assert default == PipelineConfig().schedule


@settings(max_examples=40, deadline=None)
@given(
    target=st.floats(0.05, 1.0),
    rel=st.none() | st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3),
    windows=st.none() | st.integers(1, 6),
    max_removal_ratio=st.none() | st.floats(0.05, 0.95),
)
def test_kept_fraction_shorthand_and_canonical_agree(target, rel, windows, max_removal_ratio):
    short: dict = {"kept_fraction": target}
    params: dict = {"kept_fraction": target}
    n = 3 if rel is None else len(rel)
    if rel is not None:
        short["relative_layers"] = rel
        params["relative_layers"] = rel
    if windows is not None:
        short["windows_per_side"] = [windows]
    params["windows_per_side"] = (
        [windows] * n if windows is not None else ([4, 2, 1] if rel is None else [1] * n)
    )
    if max_removal_ratio is not None:
        short["max_removal_ratio"] = max_removal_ratio
        params["max_removal_ratio"] = max_removal_ratio
    a = ScheduleConfig.model_validate(short)
    b = ScheduleConfig.model_validate({"name": "kept_fraction", "params": params})
    assert a == b and a.build() == b.build()
    assert a.build().max_removal_ratio == (0.5 if max_removal_ratio is None else max_removal_ratio)
    assert ScheduleConfig.model_validate(a.to_yaml_value()) == a


@settings(max_examples=40, deadline=None)
@given(
    layers=st.lists(st.integers(0, 40), min_size=1, max_size=4, unique=True).map(sorted),
    ratio=st.floats(0.0, 0.99),
    windows=st.sampled_from(["none", "wps", "size"]),
)
def test_explicit_shorthand_and_canonical_agree(layers, ratio, windows):
    short: dict = {"layers": layers, "removal_ratios": [ratio]}
    params: dict = {"layers": layers, "removal_ratios": [ratio], "windows_per_side": None}
    if windows == "wps":
        short["windows_per_side"] = params["windows_per_side"] = [2]
    elif windows == "size":
        short["window_size"] = params["window_size"] = [[2, 3]]
    a = ScheduleConfig.model_validate(short)
    b = ScheduleConfig.model_validate({"name": "explicit", "params": params})
    assert a == b and a.build() == b.build()
    assert a.to_yaml_value() == {k: v for k, v in short.items()}


def test_max_removal_ratio_from_the_short_form_reaches_the_scheduler():
    cfg = _schedule("  kept_fraction: 0.5\n  max_removal_ratio: 0.75\n")
    scheduler = cfg.build().scheduler
    assert isinstance(scheduler, KeptFractionSchedule) and scheduler.max_removal_ratio == 0.75
    stages = cfg.validate_for_model(32)
    assert [s.layer for s in stages] == [12, 18, 24] and stages[
        0
    ].removal_ratio > 0.5  # no move earlier needed
    assert [s.layer for s in KeptFractionSchedule(kept_fraction=0.5).plan(32)] != [
        12,
        18,
        24,
    ]  # 0.5 per stage is not enough
    assert cfg.average_kept_fraction(32) == pytest.approx(0.5, abs=1e-5)
    assert "  max_removal_ratio: 0.75\n" in cfg.to_yaml()
    assert PipelineConfig.from_yaml_text(cfg.to_yaml()) == cfg


# --------------------------------------------------------------------- scaled and budget from YAML
def test_scaled_schedule_from_yaml_moves_llava_layers_to_8():
    cfg = _schedule("  name: scaled\n  params: {layers: [12, 18, 24], ref_depth: 32}\n")
    assert cfg.schedule == ScheduleConfig(name="scaled")  # the defaults, spelled out
    stages = cfg.validate_for_model(8)
    assert [s.layer for s in stages] == list(scale_layers((12, 18, 24), 32, 8)) == [2, 4, 5]
    assert [(s.removal_ratio, s.windows_per_side) for s in stages] == [(0.5, 4), (0.5, 2), (0.5, 1)]
    assert [s.layer for s in cfg.validate_for_model(32)] == [
        12,
        18,
        24,
    ]  # as written at the reference depth
    qwen = ScaledSchedule(layers=(12, 17, 22), ref_depth=28, windows_per_side=(6, 4, 2))
    assert [(s.layer, s.windows_per_side) for s in qwen.plan(8)] == [(3, 6), (4, 4), (6, 2)]
    with pytest.raises(ValueError, match="does not fit 3 layers"):
        cfg.build().scheduler.plan(3)


@pytest.mark.parametrize(
    "depth, target, max_removal_ratio, layers, ratio, how",
    # the values of lightkv_lab.bench.quality.budget_schedule (scaled LLaVA layers, 4/2/1 windows)
    [
        (8, 0.55, 0.5, (2, 4, 5), 0.5, "scaled"),
        (8, 0.55, 0.75, (2, 4, 5), 0.5227, "scaled"),
        (8, 0.4, 0.5, (0, 2, 3), 0.4308, "scaled"),
        (8, 0.25, 0.5, (0, 1, 2, 3, 4, 5, 6), 0.498, "extra stages"),
        (6, 0.25, 0.5, (0, 1, 2, 3, 4), 0.5, "min"),
        (6, 0.55, 0.5, (1, 3, 4), 0.5, "scaled"),
        (28, 0.55, 0.5, (9, 15, 20), 0.4833, "scaled"),
    ],
)
def test_budget_schedule_from_yaml_places_stages_as_the_benchmark(
    depth, target, max_removal_ratio, layers, ratio, how
):
    cfg = _schedule(
        f"  name: budget\n  params: {{kept_fraction: {target}, max_removal_ratio: "
        f"{max_removal_ratio}}}\n"
    )
    scheduler = cfg.build().scheduler
    assert isinstance(scheduler, BudgetSchedule) and scheduler.fit(depth) == how
    stages = cfg.validate_for_model(depth)
    assert tuple(s.layer for s in stages) == layers and {s.removal_ratio for s in stages} == {ratio}
    windows = [4, 2, 1] + [1] * (len(layers) - 3)
    assert [s.windows_per_side for s in stages] == windows
    expected, expected_how = budget_schedule(
        scale_layers((12, 18, 24), 32, depth),
        depth,
        target,
        max_removal_ratio,
        windows_per_side=(4, 2, 1),
    )
    assert expected.plan(depth) == stages and expected_how == how


def test_budget_schedule_function_edge_cases():
    sched, how = budget_schedule((2, 4, 5), 8, 1.0)
    assert (
        sched == ExplicitSchedule(layers=(), removal_ratios=(), windows_per_side=None)
        and how == "scaled"
    )
    sched, how = budget_schedule((2, 4, 5), 8, 0.3, window_size=((2, 2),))
    assert (
        how == "extra stages"
        and sched.window_size == ((2, 2),) * 7
        and sched.removal_ratios == (0.4106,)
    )
    sched, how = budget_schedule((2, 4, 5), 8, 0.55, windows_per_side=None)
    assert (
        sched == ExplicitSchedule(layers=(2, 4, 5), removal_ratios=(0.5,), windows_per_side=None)
        and how == "scaled"
    )
    with pytest.raises(ValueError, match=r"kept_fraction must be in \(0, 1\]"):
        budget_schedule((2, 4, 5), 8, 0.0)
    assert BudgetSchedule(kept_fraction=1.0).plan(8) == []
    assert average_kept_fraction(BudgetSchedule(kept_fraction=0.4).plan(8), 8) == pytest.approx(
        0.4, abs=1e-3
    )


def test_scale_layers_as_the_benchmark():
    assert scale_layers((12, 18, 24), 32, 8) == (2, 4, 5)
    assert scale_layers((12, 17, 22), 28, 8) == (3, 4, 6)
    assert scale_layers((1,), 32, 8) == (0,)
    with pytest.raises(ValueError, match="does not fit"):
        scale_layers((12, 18, 24), 32, 3)


def test_new_scheduler_errors_point_at_their_parameter():
    assert (
        "target kept fraction must be in (0, 1], got 1.5"
        in _problems({"name": "budget", "params": {"kept_fraction": 1.5}})[
            "schedule.params.kept_fraction"
        ]
    )
    msg = _problems({"name": "scaled", "params": {"layers": [12, 40], "windows_per_side": [1]}})[
        "schedule.params.layers"
    ]
    assert "only 32 layers" in msg and "ref_depth=32" in msg
    assert (
        "strictly increasing"
        in _problems({"name": "explicit", "params": {"layers": [3, 3], "windows_per_side": [1]}})[
            "schedule.params.layers.1"
        ]
    )
    assert (
        "valid integer, got True"
        in _problems({"name": "scaled", "params": {"ref_depth": True}})["schedule.params.ref_depth"]
    )
    assert (
        "has no parameter 'tolerence'"
        in _problems({"name": "budget", "params": {"tolerence": 0.1}})["schedule.params.tolerence"]
    )
    assert "got layers and name" in _problems({"name": "budget", "layers": [1]})["schedule"]
    assert (
        "max_removal_ratio cannot be combined with layers"
        in _problems({"layers": [1], "removal_ratios": 0.5, "max_removal_ratio": 0.6})[
            "schedule.max_removal_ratio"
        ]
    )
    assert "finite" in _problems({"kept_fraction": float("inf")})["schedule.kept_fraction"]


def test_stage_overrides_with_a_budget_schedule_are_checked_against_the_model():
    cfg = PipelineConfig.from_dict(
        {"schedule": {"name": "budget"}, "stage_overrides": {5: {"scorer": "l2"}}}
    )
    assert cfg.schedule.max_stages() is None  # stages depend on the depth: checked per model
    assert (
        len(
            PipelineConfig.from_dict(
                {"schedule": {"name": "budget", "params": {"kept_fraction": 0.25}}}
            ).validate_for_model(8)
        )
        == 7
    )
    with pytest.raises(ConfigError, match="stage 5 does not exist"):
        cfg.validate_for_model(8)
    with pytest.raises(ConfigError, match="beyond the schedule, which has 3 stage"):
        PipelineConfig.from_dict(
            {"schedule": {"name": "scaled"}, "stage_overrides": {3: {"scorer": "l2"}}}
        )


# ---------------------------------------------------------------------------- round trips
NEW_SCHEDULES = [
    {"name": "scaled"},
    {
        "name": "scaled",
        "params": {"layers": [12, 17, 22], "ref_depth": 28, "windows_per_side": [6, 4, 2]},
    },
    {
        "name": "scaled",
        "params": {"layers": [12], "removal_ratios": [0.75], "window_size": [[2, 2]]},
    },
    {
        "name": "budget",
        "params": {"kept_fraction": 0.4, "max_removal_ratio": 0.75, "tolerance": 0.0},
    },
    {"name": "budget", "params": {"layers": [1], "windows_per_side": None}},
    {
        "kept_fraction": 0.3,
        "relative_layers": [0.5],
        "windows_per_side": [2],
        "max_removal_ratio": 0.9,
    },
]


@pytest.mark.parametrize(
    "config",
    [p.config for p in PRESETS.values()]
    + [PipelineConfig.from_dict({"name": "new", "schedule": s}) for s in NEW_SCHEDULES],
    ids=list(PRESETS) + [f"new-{i}" for i in range(len(NEW_SCHEDULES))],
)
def test_config_yaml_config_round_trip(config):
    text = config.to_yaml()
    again = PipelineConfig.from_yaml_text(text)
    assert again == config and again.to_yaml() == text
    assert again.build() == config.build()
    assert config_from_pipeline(config.build()).schedule == config.schedule


def test_json_schema_describes_every_schedule_form():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json_schema())
    schedule = json_schema()["$defs"]["ScheduleConfig"]
    names = schedule["anyOf"][2]["enum"]
    assert {"explicit", "kept_fraction", "scaled", "budget"} <= set(names)
    for data in NEW_SCHEDULES + [
        {"layers": 3, "removal_ratios": 0.5},
        "budget",
        {"name": "explicit"},
    ]:
        assert not list(validator.iter_errors({"schedule": data})), data
        PipelineConfig.from_dict({"schedule": data})  # and lightkv accepts them
    for data in [
        {"name": "budget", "params": {"tolerence": 0.1}},
        {"kept_fraction": 0.5, "removal_ratios": [0.5]},
        {"name": "nope"},
        {"layers": [1]},
    ]:
        assert list(validator.iter_errors({"schedule": data})), data


# ---------------------------------------------------------------------------- layering
def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_config_and_schedulers_import_only_downwards():
    for path in (ROOT / "lightkv" / "config").glob("*.py"):
        for name in _imports(path):
            assert not any(
                bad in name for bad in ("presets", "adapters", "bench", "cli", "demo")
            ), (path.name, name)
    for path in (ROOT / "lightkv" / "policies" / "schedulers").glob("*.py"):
        for name in _imports(path):
            assert name.startswith(".") or name in (
                "__future__",
                "collections.abc",
                "dataclasses",
                "typing",
            ), (path.name, name)
            assert not name.startswith("..") or name in ("...graph.windows", "..base"), (
                path.name,
                name,
            )
