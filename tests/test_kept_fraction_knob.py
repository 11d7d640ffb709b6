"""The kept-fraction knob (issue 52 item 2): ``lightkv.load(name, kept_fraction=t)`` puts a
preset at a kept vision-KV fraction on the model's depth, each scheduler family keeping where
its stages run; a target out of reach is one line naming the nearest reachable fraction."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightkv
from lightkv.cli import main
from lightkv.config import ConfigError, PipelineConfig, json_schema
from lightkv.policies import (
    BudgetSchedule,
    ExplicitSchedule,
    GlobalPartitioner,
    GridPartitioner,
    KeptFractionOutOfReach,
    RelevanceSplit,
    ScaledSchedule,
    ScheduleError,
    Scheduler,
    SmallestDivergence,
    StageSpec,
)
from lightkv.policies.schedulers import REACH_TOLERANCE
from lightkv.presets import PRESETS
from lightkv.testing import IMAGE, TINY_LLAVA

MUST_SHOW = (
    "fastv",
    "pdrop",
    "tome",
    "divprune",
    "cdpruner",
    "dart",
    "scope",
    "visionzip",
    "vispruner",
    "mmtok",
    "lightkv",
    "lightkv-cover",
)
TARGETS = (0.55, 0.22, 0.11)
PRE_LLM = {"divprune", "cdpruner", "scope", "visionzip", "vispruner", "mmtok", "lightkv-cover"}
# The points a method cannot reach on 32 layers with its stages where they are: PDrop's first
# stage after layer 7 leaves 8/32 of the layers whole; ToMe and LightKV merge at most half of
# each window after layers 12, 18, 24 (0.574 at best). A refusal that appears or disappears
# fails the test: the table is what lightkv promises.
REFUSED = {
    (name, t): near
    for name, near in (("pdrop", 0.253), ("tome", 0.574), ("lightkv", 0.574))
    for t in (0.22, 0.11)
}


def _kept_oracle(stages: list[StageSpec], depth: int) -> float:
    """An independent oracle: walk the layers as the model runs them and average the share
    of the vision KV each layer caches."""
    total = 0.0
    for layer in range(depth):
        kept = 1.0
        for s in stages:
            if (
                s.mode == "pre_llm"
                or (s.mode == "layer" and s.layer < layer)
                or (s.mode == "cache" and s.layer == layer)
            ):
                kept *= 1.0 - s.removal_ratio
        total += kept
    return total / depth


@pytest.fixture(scope="module")
def llava32():
    """A tiny-width LLaVA-1.5-shaped model with 32 decoder layers and 24x24 = 576 vision
    tokens per image."""
    model = TINY_LLAVA.build(
        num_layers=32, image_size=96, patch_size=4, hidden_size=32, intermediate_size=64
    )
    batch = TINY_LLAVA.collate([TINY_LLAVA.row(model, images=1, seed=0)])
    return model, batch


@pytest.mark.parametrize("name", MUST_SHOW)
def test_every_preset_at_55_22_11_percent_on_a_32_layer_llava(llava32, name):
    model, batch = llava32
    assert int((batch["input_ids"] == IMAGE).sum()) == 576  # 576 vision tokens
    for t in TARGETS:
        pipe = lightkv.load(name, kept_fraction=t)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a session that misses its target warns
                with lightkv.apply(pipe, model) as session, torch.no_grad():
                    model(**batch)
        except KeptFractionOutOfReach as e:
            message = str(e)
            assert (name, t) in REFUSED, f"{name} at {t} was refused: {message}"
            assert (
                "\n" not in message
                and f"nearest reachable kept fraction is {REFUSED[name, t]}" in message
            )
            assert e.nearest > t + REACH_TOLERANCE and e.target == t
            continue
        assert (name, t) not in REFUSED, f"{name} at {t} ran, but should be refused"
        report = session.report()
        assert report.target_kept_fraction == t  # the report's target is the knob's
        assert abs(report.kept_vision_fraction - t) <= 0.03, (name, t, report.kept_vision_fraction)
        stages = [s.spec for s in session.stages]
        if name in PRE_LLM:  # pre-LLM methods stay before the LLM
            assert [(s.mode, s.layer) for s in stages] == [("pre_llm", 0)]
        elif name in ("fastv", "dart"):  # FastV and DART stay after their layer (K = 2)
            assert [(s.mode, s.layer) for s in stages] == [("layer", 1)]
        else:  # the others keep their layers and change their ratio
            layers = lightkv.load(name).scheduler.layers
            assert [(s.mode, s.layer) for s in stages] == [("layer", at) for at in layers]


def test_fastv_moves_its_ratio_not_its_layer():
    fastv = lightkv.load("fastv").at_kept_fraction(0.25)
    assert [(s.layer, s.removal_ratio) for s in fastv.plan(32)] == [(1, 0.8)]
    assert fastv.target_kept_fraction(32) == 0.25
    # FastV's K = 2 is absolute: on 8 layers the stage stays after layer 1, where layers 0 and
    # 1 keep everything: 25% runs at ratio 0.99 (0.2575, within the tolerance), 20% is refused
    assert [(s.layer, s.removal_ratio) for s in fastv.plan(8)] == [(1, 0.99)]
    with pytest.raises(KeptFractionOutOfReach, match="nearest reachable kept fraction is 0.258"):
        fastv.at_kept_fraction(0.2).plan(8)
    assert fastv.at_kept_fraction(0.2).target_kept_fraction(8) is None
    assert [s.layer for s in fastv.at_kept_fraction(0.5).plan(8)] == [1]


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 40).flatmap(
        lambda depth: st.tuples(
            st.just(depth),
            st.lists(st.integers(0, depth - 2), min_size=1, max_size=4, unique=True).map(sorted),
            st.floats(0.02, 1.0),
            st.sampled_from([0.5, 0.75, 1.0]),
        )
    )
)
def test_explicit_schedules_keep_their_layers_and_fit_one_ratio(case):
    depth, layers, t, cap = case
    sched = ExplicitSchedule(layers=tuple(layers), removal_ratios=(0.3,), windows_per_side=(1,))
    limit = min(cap, 0.99)
    lowest = _kept_oracle([StageSpec(at, limit, windows_per_side=1) for at in layers], depth)
    try:
        out = sched.at_kept_fraction(t, depth, cap)
    except KeptFractionOutOfReach as e:
        assert lowest > t + REACH_TOLERANCE and e.nearest == pytest.approx(lowest)
        return
    assert tuple(out.layers) == tuple(layers) and len(out.removal_ratios) == 1
    ratio = out.removal_ratios[0]
    assert 0.0 <= ratio <= limit
    kept = _kept_oracle(out.plan(depth), depth)
    if lowest <= t:  # reachable: the ratio fits the target (to its 4 decimals)
        assert kept == pytest.approx(t, abs=1e-3) and kept <= t + 1e-3
    else:  # within the tolerance: the stages at their limit
        assert ratio == pytest.approx(limit) and kept <= t + REACH_TOLERANCE


def test_each_family_keeps_where_its_stages_run():
    # pre-LLM: one stage before the LLM at 1 - t
    (stage,) = lightkv.load("divprune", kept_fraction=0.3).plan(24)
    assert (stage.mode, stage.layer, stage.removal_ratio) == ("pre_llm", 0, pytest.approx(0.7))
    # VScan: both stages stay; the later one keeps its depth and ratio, the first is fitted
    vscan = lightkv.load("vscan")
    for depth in (8, 28, 32):
        own = vscan.plan(depth)
        fitted = vscan.at_kept_fraction(0.2).plan(depth)
        assert [(s.mode, s.layer) for s in fitted] == [(s.mode, s.layer) for s in own]
        assert fitted[1].removal_ratio == own[1].removal_ratio
        assert _kept_oracle(fitted, depth) == pytest.approx(0.2, abs=1e-5)
    with pytest.raises(KeptFractionOutOfReach, match="the first removing nothing"):
        vscan.at_kept_fraction(0.95).plan(32)  # the later stage alone keeps less
    # the cache: every layer keeps t of its vision KV
    cache = lightkv.load("elasticcache", kept_fraction=0.4).plan(8)
    assert [s.layer for s in cache] == list(range(8)) and {s.mode for s in cache} == {"cache"}
    assert _kept_oracle(cache, 8) == pytest.approx(0.4)
    # an explicit schedule written for 32 layers that does not fit 8 is scaled from 32
    assert [s.layer for s in lightkv.load("lightkv", kept_fraction=0.55).plan(8)] == [2, 4, 5]
    # target-driven schedulers take the target as theirs
    budget = lightkv.load("lightkv-budget", kept_fraction=0.4)
    assert budget.scheduler_at(28).kept_fraction == 0.4
    assert _kept_oracle(budget.plan(28), 28) == pytest.approx(0.4, abs=1e-5)
    with pytest.raises(KeptFractionOutOfReach, match="nearest reachable kept fraction is 0.246"):
        lightkv.load("lightkv-budget", kept_fraction=0.11).plan(32)
    sched = BudgetSchedule(kept_fraction=0.55).at_kept_fraction(0.3, 16)
    assert sched.kept_fraction == 0.3 and sched.fit(16) != "min"
    scaled = ScaledSchedule().at_kept_fraction(0.6, 8)
    assert scaled.layers == (2, 4, 5) and _kept_oracle(scaled.plan(8), 8) == pytest.approx(
        0.6, abs=1e-3
    )


def test_h2o_gets_its_budget():
    h2o = lightkv.load("h2o", kept_fraction=0.3)
    assert h2o.plan(8) == [] and h2o.mode_at(8).budget == 0.3
    assert h2o.target_kept_fraction(8) == 0.3
    some = h2o.with_mode(type(h2o.mode)(layers=(4, 5, 6, 7))).at_kept_fraction(
        0.7
    )  # on four of eight layers: a budget of 0.4 each
    assert some.mode_at(8).budget == pytest.approx(0.4)
    assert some.mode_at(8).target_kept_fraction(8) == pytest.approx(0.7)
    with pytest.raises(KeptFractionOutOfReach, match="nearest reachable kept fraction is 0.500"):
        some.at_kept_fraction(0.3).plan(8)


def test_the_policies_limits_bound_the_ratio():
    spec = StageSpec(0, 0.5, windows_per_side=1)
    assert GridPartitioner().max_removal_ratio(spec) == 0.5
    assert GridPartitioner(split="all_src").max_removal_ratio(spec) == 1.0
    assert GlobalPartitioner(src_parity=1).max_removal_ratio(spec) == 0.5  # ToMe
    assert RelevanceSplit(sources="ratio").max_removal_ratio(spec) == 1.0
    assert RelevanceSplit(sources=0.25).max_removal_ratio(spec) == 0.25
    assert SmallestDivergence(cap="half").max_removal_ratio() == 0.5
    pool = lightkv.load("pool")
    assert pool.max_removal_ratio(0, pool.plan(32)[0]) == 0.75  # 2x2 windows keep their anchor
    # a parity split before the LLM keeps at least half: 30% is refused, 48% runs at 0.5
    pre = lightkv.load("lightkv-pre-llm")
    with pytest.raises(KeptFractionOutOfReach, match="removal ratio at most 0.5"):
        pre.at_kept_fraction(0.3).plan(32)
    assert pre.at_kept_fraction(0.48).plan(32)[0].removal_ratio == 0.5
    assert pre.at_kept_fraction(0.52).plan(32)[0].removal_ratio == pytest.approx(0.48)


def test_bad_targets_and_schedulers_without_a_knob_are_one_line():
    for bad in (0, 0.0, -0.1, 1.5, math.nan, True, "0.5"):
        with pytest.raises(ValueError, match="kept_fraction must be"):
            lightkv.load("fastv", kept_fraction=bad)
    assert lightkv.load("fastv", kept_fraction=1).plan(32)[0].removal_ratio == 0.0

    class Fixed(Scheduler):  # a plugin scheduler that does not override the knob
        def plan(self, num_layers):
            return [StageSpec(0, 0.5, windows_per_side=1)]

    pipe = lightkv.Pipeline(scheduler=Fixed(), kept_fraction=0.5)
    with pytest.raises(ScheduleError, match="has no kept-fraction knob") as info:
        pipe.plan(8)
    assert "\n" not in str(info.value)
    assert pipe.target_kept_fraction(8) is None
    assert lightkv.Pipeline(scheduler=Fixed()).knob().startswith("nothing")


def test_every_preset_says_what_the_knob_moves(capsys):
    assert main(["presets", "-v"]) == 0
    out = capsys.readouterr().out
    assert out.count("kept_fraction moves: ") == len(PRESETS)
    for name in PRESETS:
        assert not lightkv.load(name).knob().startswith("nothing"), name
    assert "stages after layers 12, 18, 24" in lightkv.load("lightkv").knob()
    assert "before the LLM" in lightkv.load("divprune").knob()
    assert "budget" in lightkv.load("h2o").knob()


YAML = """\
name: fastv-22
schedule: {layers: [1], removal_ratios: [0.5]}
partitioner: {name: global, params: {scope: row, split: all_src}}
scorer: null
pruner: lowest_relevance
passer: drop
relevance: last_token
kept_fraction: 0.22
"""


def test_a_pipeline_file_spells_the_knob_at_top_level(tmp_path):
    cfg = PipelineConfig.from_yaml_text(YAML)
    assert cfg.kept_fraction == 0.22 and cfg.to_dict()["kept_fraction"] == 0.22
    assert PipelineConfig.from_yaml_text(cfg.to_yaml()) == cfg
    (stage,) = cfg.validate_for_model(32)
    assert stage.layer == 1 and stage.removal_ratio == pytest.approx(0.832)
    path = tmp_path / "fastv-22.yaml"
    path.write_text(YAML)
    pipe = lightkv.load(path)
    assert pipe.kept_fraction == 0.22 and lightkv.load(path, kept_fraction=0.5).kept_fraction == 0.5
    assert "kept_fraction: 0.22" in lightkv.to_yaml(pipe)  # and back to YAML
    assert "kept_fraction" not in lightkv.to_yaml(lightkv.load("fastv"))
    for bad in ("0", "1.5", "true", "'0.5'", "-1"):
        with pytest.raises(ConfigError, match="kept_fraction"):
            PipelineConfig.from_yaml_text(YAML.replace("0.22", bad))
    with pytest.raises(
        ConfigError, match="kept_fraction: .*nearest reachable kept fraction is 0.574"
    ):
        PipelineConfig.from_dict(
            {**PRESETS["lightkv"].config.to_dict(), "kept_fraction": 0.2}
        ).validate_for_model(32)
    prop = json_schema()["properties"]["kept_fraction"]
    number = next(v for v in prop["anyOf"] if v.get("type") == "number")
    assert number["exclusiveMinimum"] == 0.0 and number["maximum"] == 1.0
    json.dumps(prop)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(cfg.to_dict(), json_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**cfg.to_dict(), "kept_fraction": 1.5}, json_schema())


def test_the_command_line_takes_the_knob(capsys):
    assert (
        main(["config", "validate", "fastv", "--kept-fraction", "0.25", "--num-layers", "32"]) == 0
    )
    out = capsys.readouterr().out
    assert "at kept_fraction 0.25" in out and "after layer 1, removal ratio 0.8" in out
    assert main(["config", "validate", "lightkv", "--kept-fraction", "0.22"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "nearest reachable kept fraction is 0.574" in err
    assert main(["config", "validate", "fastv", "--kept-fraction", "0"]) == 2
    assert "(0, 1]" in capsys.readouterr().err
    assert main(["config", "show", "divprune", "--kept-fraction", "0.3"]) == 0
    assert "kept_fraction: 0.3" in capsys.readouterr().out
    from lightkv.cli import parse_args

    args = parse_args(
        ["generate", "--model", "x", "--image", "a.png", "--prompt", "p", "--kept-fraction", "0.4"]
    )
    assert args.kept_fraction == 0.4


def test_the_guide_lists_every_preset_under_its_schedule():
    """docs/guides/pipelines.md's knob table (written by hand: the docs build imports nothing)
    names each preset's schedule as the code has it."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "guides" / "pipelines.md"
    lines = page.read_text(encoding="utf-8").splitlines()
    start = lines.index(
        "| schedule | presets | `kept_fraction` moves | the least it keeps on 32 layers |"
    )
    listed = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        family, presets = (cell.strip() for cell in line.strip("|").split("|")[:2])
        for name in re.findall(r"`([^`]+)`", presets):
            listed[name] = family.replace("`", "")
    actual = {}
    for name in PRESETS:
        pipe = lightkv.load(name)
        actual[name] = pipe.scheduler.name if pipe.scheduler else f"mode {pipe.mode.name}"
    assert listed == actual
