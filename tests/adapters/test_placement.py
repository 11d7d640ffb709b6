"""Placement independent of method (issue 37 item 4): every preset's stages run before the
LLM, after a decoder layer or on the cache by the one ``placement`` field, at the planned
budget, or are refused in one line that says why."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.config import ConfigError, PipelineConfig
from lightkv.policies import ExplicitSchedule, StageSpec, average_kept_fraction
from lightkv.policies.schedulers import place, scale_layers
from lightkv.presets import PRESETS, get_preset_config

DEPTH = 8
PLACES = ("pre_llm", "layer", "cache")

# (preset, placement) -> why it is refused: every other combination must run. A refusal that
# appears or disappears fails the test, so the table is what lightkv promises.
REFUSED = {
    **{("vscan", p): "stage_overrides name stages of the schedule's own places" for p in PLACES},
    **{
        (name, "cache"): "cannot compute relevance"
        for name in (
            "lightkv-cover",
            "visionzip",
            "vispruner",
            "scope",
            "holov",
            "prumerge-plus",
            "sparsevlm",
            "tops",
            "era",
        )
    },
    ("trim", "cache"): "needs the prompt",
    **{(name, p): "would never run" for name in ("h2o",) for p in PLACES},
    **{
        (name, p): "released_quirks"
        for name in ("lightkv-paper-released", "lightkv-paper-released-qwen2_5_vl")
        for p in ("pre_llm", "cache")
    },
}
ADAPTIVE = {"prumerge-plus", "trim"}
"""Presets whose count is their method's own wherever they run (``pre_llm_adaptive``)."""
# Combinations that run short of the planned budget, and say so (`SessionReport.missed_target`):
# one merge stage with a parity split removes at most half of each window, and the pooling
# preset's 2 x 2 windows a quarter, while a multi-stage schedule compounds its ratios.
# On the cache, each layer's stage removes what all planned stages before it removed
# together (0.75 after two LightKV stages), which one parity split cannot either.
SHORT = {
    *(
        (name, "pre_llm")
        for name in (
            "lightkv",
            "lightkv-budget",
            "lightkv-no-relevance",
            "lightkv-paper",
            "lightkv-paper-qwen2_5_vl",
            "lightkv-qwen2_5_vl",
            "lightkv-video",
            "lightkv-video-paper",
            "pool",
        )
    ),
    *((name, "cache") for name in ("lightkv", "lightkv-no-relevance", "lightkv-video", "tome")),
}


def _kept_per_layer(stages: list[StageSpec], depth: int) -> list[float]:
    """An independent oracle: the share of the vision KV each layer's cache keeps, walking
    the stages as the model runs them (before a layer, in its cache, after it)."""
    out = []
    for layer in range(depth):
        kept = 1.0
        for s in stages:
            if (
                (s.mode == "pre_llm" and layer >= 0)
                or (s.mode == "layer" and s.layer < layer)
                or (s.mode == "cache" and s.layer == layer)
            ):
                kept *= 1.0 - s.removal_ratio
        out.append(kept)
    return out


layer_schedules = st.integers(2, 12).flatmap(
    lambda depth: st.tuples(
        st.just(depth),
        st.lists(st.integers(0, depth - 1), min_size=1, max_size=4, unique=True).map(sorted),
        st.floats(0.05, 0.6),
    )
)


@settings(max_examples=60, deadline=None)
@given(layer_schedules)
def test_cache_placement_keeps_each_layers_planned_share(case):
    depth, layers, ratio = case
    stages = [StageSpec(layer, ratio, windows_per_side=1) for layer in layers]
    placed = place(stages, "cache", depth)
    assert all(s.mode == "cache" for s in placed)
    want, got = _kept_per_layer(stages, depth), _kept_per_layer(placed, depth)
    assert got == pytest.approx(want, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(layer_schedules)
def test_pre_llm_and_layer_placements_keep_the_planned_average(case):
    depth, layers, ratio = case
    stages = [StageSpec(layer, ratio, windows_per_side=1) for layer in layers]
    target = sum(_kept_per_layer(stages, depth)) / depth
    (one,) = place(stages, "pre_llm", depth)
    assert one.mode == "pre_llm" and one.layer == 0
    assert sum(_kept_per_layer([one], depth)) / depth == pytest.approx(target)
    assert place(stages, "layer", depth) == stages  # already after layers
    assert place(stages, "planned", depth) == stages
    # and back: a pre-LLM stage moved after layer 0 keeps the same average, when it can
    try:
        (after,) = place([one], "layer", depth)
    except ValueError as e:
        assert "cannot keep" in str(e) and 1.0 - target > (depth - 1) / depth - 1e-9
    else:
        assert after.mode == "layer" and after.layer == 0
        assert sum(_kept_per_layer([after], depth)) / depth == pytest.approx(target)
    assert average_kept_fraction(place(stages, "cache", depth), depth) == pytest.approx(target)


def test_unknown_placements_and_text_are_refused():
    with pytest.raises(ValueError, match="unknown placement 'before'; choose one of planned"):
        lightkv.Pipeline(placement="before")
    with pytest.raises(ConfigError, match="placement"):
        PipelineConfig.from_yaml_text("placement: before")
    cfg = PipelineConfig.from_yaml_text(
        "schedule: {layers: [1, 3], removal_ratios: 0.5}\nplacement: cache"
    )
    assert cfg.to_dict()["placement"] == "cache"
    assert PipelineConfig.from_yaml_text(cfg.to_yaml()) == cfg
    assert [s.layer for s in cfg.validate_for_model(4)] == [2, 3]
    assert (
        "placement"
        not in PipelineConfig.from_yaml_text(
            "schedule: {layers: [1], removal_ratios: 0.5}"
        ).to_dict()
    )


@pytest.fixture(scope="module")
def models():
    llava, qwen = TINY_MODELS["llava"], TINY_MODELS["qwen2_5_vl"]
    m1 = llava.build(num_layers=DEPTH)
    m2 = qwen.build(num_layers=DEPTH)
    b1 = llava.collate([llava.row(m1, images=1, seed=0), llava.row(m1, images=2, seed=1)])
    b2 = qwen.collate([qwen.row(m2, images=1, seed=0)])
    return {"llava": (m1, b1), "qwen2_5_vl": (m2, b2)}


def _config(name: str, placement: str) -> PipelineConfig:
    """The preset at ``placement``, its fixed layers (written for 32 or 28 layers) scaled to
    the tiny decoder's depth."""
    data = get_preset_config(name).to_dict()
    pipe = get_preset_config(name).build()
    if isinstance(pipe.scheduler, ExplicitSchedule):
        ref = 28 if "qwen" in name else 32
        sched = dataclasses.replace(
            pipe.scheduler, layers=scale_layers(pipe.scheduler.layers, ref, DEPTH)
        )
        data["schedule"] = {"name": "explicit", "params": sched.params()}
    return PipelineConfig.from_dict({**data, "placement": placement})


def _run(pipe, model, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with lightkv.apply(pipe, model) as session, torch.no_grad():
            model(**batch)
    return session


@pytest.mark.parametrize("placement", PLACES)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_runs_at_every_placement_or_says_why(models, name, placement):
    model, batch = models["qwen2_5_vl" if "qwen" in name or "video" in name else "llava"]
    why = REFUSED.get((name, placement))
    try:
        cfg = _config(name, placement)
        cfg.validate_for_model(DEPTH)
        pipe = cfg.build()
        session = _run(pipe, model, batch)
    except (ConfigError, ValueError) as e:
        message = str(e)
        assert why is not None, f"{name} at {placement} was refused: {message}"
        assert why in message and "\n" not in message.strip(), message
        return
    assert why is None, f"{name} at {placement} ran, but it should be refused ({why})"
    assert {s.spec.mode for s in session.stages} == {placement}
    planned = _run(_config(name, "planned").build(), model, batch).report()
    report = session.report()
    assert report.target_kept_fraction == pytest.approx(pipe.target_kept_fraction(DEPTH))
    assert pipe.target_kept_fraction(DEPTH) == pytest.approx(
        average_kept_fraction(pipe.plan(DEPTH), DEPTH)
    )
    if name in ADAPTIVE:  # the method's own count (IQR outliers), not a budget
        assert 0 < report.kept_vision_fraction <= 1
    elif (name, placement) in SHORT:  # told, not silent
        assert report.missed_target is not None
        assert report.kept_vision_fraction >= planned.kept_vision_fraction
    else:  # the same budget, up to rounding on 64-token images
        assert report.kept_vision_fraction == pytest.approx(planned.kept_vision_fraction, abs=0.1)
