"""Declarative pipelines: schema, YAML round trips, presets, JSON Schema, error messages."""

from __future__ import annotations

import dataclasses
import math
from importlib import resources

import pytest
import torch
import torch.nn.functional as F
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import lightkv
from lightkv import ImageSegment, Pipeline, VisionLayout
from lightkv.config import (
    ConfigError,
    PipelineConfig,
    PolicySpec,
    ScheduleConfig,
    config_from_pipeline,
    json_schema,
    pipeline_from_yaml,
    pipeline_to_yaml,
)
from lightkv.methods.pooling import AnchorPartitioner, StridedPartitioner
from lightkv.policies import (
    FAMILIES,
    CosineDivergence,
    ExplicitSchedule,
    GlobalPartitioner,
    KeptFractionSchedule,
    L2Divergence,
    Prompt,
    StageInputs,
)
from lightkv.presets import PRESETS, Preset, get_preset, get_preset_config, load_config

PRESET_NAMES = list(PRESETS)
REQUIRED = {
    "lightkv",
    "lightkv-paper",
    "fastv",
    "tome",
    "pdrop",
    "random",
    "pool",
    "lightkv-qwen2_5_vl",
}


def llava_layout(grid=(24, 24), before=5, after=9, rows=1):
    n = before + grid[0] * grid[1] + after
    return VisionLayout.from_segments(
        rows, n, [ImageSegment(row=r, offset=before, grid=grid) for r in range(rows)]
    )


def problems(exc: ConfigError) -> dict[str, str]:
    return dict(exc.problems)


# ---------------------------------------------------------------------------- presets
def test_required_presets_are_shipped_as_yaml():
    assert REQUIRED <= set(PRESETS)
    files = {
        e.name for e in resources.files("lightkv.methods").iterdir() if e.name.endswith(".yaml")
    }
    assert files == {f"{n}.yaml" for n in PRESETS}
    assert PRESET_NAMES[0] == "lightkv"


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_yaml_round_trip_is_exact(name):
    text = (resources.files("lightkv.methods") / f"{name}.yaml").read_text(encoding="utf-8")
    cfg = PipelineConfig.from_yaml_text(text)
    # the shipped file is in canonical form; after editing one, canonicalise it with
    # `lightkv config show lightkv/methods/NAME.yaml > tmp && mv tmp lightkv/methods/NAME.yaml`
    assert cfg.to_yaml() == text, f"{name}.yaml is not in canonical form"
    again = PipelineConfig.from_yaml_text(cfg.to_yaml())
    assert again == cfg
    assert again.model_dump() == cfg.model_dump()
    assert again.build() == cfg.build()


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_pipeline_to_config_round_trip(name):
    preset = PRESETS[name]
    pipe = preset.build()
    cfg = config_from_pipeline(
        pipe, summary=preset.summary, description=preset.description, source=preset.source
    )
    assert cfg.build() == pipe
    # the same up to parameters the preset spells out although they equal the defaults
    assert cfg.schedule == preset.config.schedule
    for field in ("partitioner", "scorer", "pruner", "passer", "relevance"):
        ours, theirs = getattr(cfg, field), getattr(preset.config, field)
        assert (ours and ours.name) == (theirs and theirs.name)
        if ours is not None:
            assert ours.params.items() <= theirs.params.items()
    assert PipelineConfig.from_yaml_text(pipeline_to_yaml(pipe)).build() == pipe


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_preset_has_summary_description_and_source(name):
    p = PRESETS[name]
    assert isinstance(p, Preset) and p.name == name
    assert p.summary and "\n" not in p.summary and len(p.summary) <= 80
    assert len(p.description) > 150 and "\n" not in p.description
    assert p.source
    # the description cites a paper (a year) or says it is a baseline
    assert (
        any(str(y) in p.description + p.source for y in range(2019, 2030)) or "baseline" in p.source
    )


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_released_quirks_only_in_the_released_presets(name):
    # lightkv-paper-released* = lightkv-paper* + the released code's quirks; nothing else has them
    pipe = PRESETS[name].build()
    released = name.startswith("lightkv-paper-released")
    assert pipe.released_quirks.any == released
    # the reference code's float32 budget is arithmetic, not a quirk: every lightkv-paper* preset
    # has it
    assert (getattr(pipe.pruner, "budget_dtype", "float64") == "float32") == name.startswith(
        "lightkv-paper"
    )
    assert (pipe.relevance.name == "random") == (name == "lightkv-paper-released")
    if released:
        base = PRESETS[name.replace("-released", "")].build()
        assert (
            dataclasses.replace(
                pipe, name=base.name, relevance=base.relevance, released_quirks=base.released_quirks
            )
            == base
        )
        assert pipe.released_quirks.enabled() == [
            "renumber_positions",
            "unmasked_first_merge",
            "eager_merge_layers",
        ]


def test_released_quirks_in_yaml():
    text = "name: x\nreleased_quirks: {renumber_positions: true}\n"
    cfg = PipelineConfig.from_yaml_text(text)
    assert cfg.build().released_quirks.enabled() == ["renumber_positions"]
    assert cfg.to_yaml().endswith("released_quirks: {renumber_positions: true}\n")
    assert "released_quirks" not in PipelineConfig.from_yaml_text("name: x\n").to_yaml()
    with pytest.raises(ConfigError) as e:
        PipelineConfig.from_yaml_text(
            "name: x\nreleased_quirks: {renumber_position: true, unmasked_first_merge: 1}\n"
        )
    got = problems(e.value)
    assert "did you mean 'renumber_positions'?" in got["released_quirks.renumber_position"]
    assert "boolean" in got["released_quirks.unmasked_first_merge"]
    assert set(json_schema()["$defs"]["ReleasedQuirksConfig"]["properties"]) == {
        "renumber_positions",
        "unmasked_first_merge",
        "eager_merge_layers",
    }


CACHE_MODE = ("elasticcache", "h2o")


def check_cache_preset(pipe, layout, relevance):
    from lightkv.adapters.modes.h2o import H2OMode
    from lightkv.cache_stage import CacheStage

    if isinstance(pipe.mode, H2OMode):  # eviction is the mode's, at every decoding step
        assert pipe.scheduler is None and pipe.stages(32) == []
        assert pipe.mode.evict_layers(32) == list(range(32))
        return
    with pytest.raises(ValueError, match="CacheStage"):
        pipe.run(torch.zeros(1, layout.seq_len, 64), layout, num_layers=32)
    gen = torch.Generator().manual_seed(2)
    keys, values = (torch.randn(1, 2, layout.seq_len, 8, generator=gen) for _ in range(2))
    stages = pipe.stages(32)
    assert len(stages) == 32 and all(s.spec.mode == "cache" for s in stages)
    out = CacheStage(stages[0])(keys, values, layout, relevance)
    assert int(out.result.layout.vision_counts()[0]) == 288
    assert int((out.result.layout.kind == lightkv.TokenKind.TEXT).sum()) == 14


PROMPT_ONLY = {"trim"}
RANKED = {"sparsevlm"}
ADAPTIVE = {"prumerge-plus", "trim"}


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_runs_on_a_llava_layout(name):
    layout = llava_layout()
    hidden = torch.randn(1, layout.seq_len, 64, generator=torch.Generator().manual_seed(0))
    relevance = torch.rand(1, layout.seq_len, generator=torch.Generator().manual_seed(1))
    pipe = lightkv.load(name)
    if name in CACHE_MODE:  # stages on a layer's cache, not on hidden states
        return check_cache_preset(pipe, layout, relevance)
    keys = None
    if any(
        "key_states" in s.needs for s in pipe.stages(32)
    ):  # e.g. DART's pivots: a clear refusal without keys
        with pytest.raises(ValueError, match="this stage has no key_states features"):
            pipe.run(hidden, layout, num_layers=32)
        keys = torch.randn(1, layout.seq_len, 2, 8, generator=torch.Generator().manual_seed(2))
    # a preset that ranks by the tower's attention needs a relevance (and the tower layers its
    # policies read: VScan's local scan); the others run without one too
    layers = {i for s in pipe.stages(32) for i in s.tower_layers}
    tower = {i: relevance.unsqueeze(1).expand(-1, 2, -1) for i in layers} or None
    prompt = None
    if name in PROMPT_ONLY:  # TRIM ranks by the question: a clear refusal without the prompt
        with pytest.raises(ValueError, match="needs the prompt"):
            pipe.run(hidden, layout, num_layers=32)
        prompt = Prompt(torch.arange(layout.seq_len).unsqueeze(0))
    if name in RANKED:  # SparseVLM's stages rank by the raters' attention: refused without it
        with pytest.raises(ValueError, match="ranks by the raters' attention"):
            pipe.run(hidden, layout, num_layers=32, prompt=prompt)
    ranked = pipe.relevance.reads_tower or name in RANKED
    for rel in (relevance,) if ranked else (None, relevance):
        results = pipe.run(
            hidden, layout, num_layers=32, relevance=rel, key_states=keys, tower=tower,
            prompt=prompt,
        )  # fmt: skip
        assert results, name
        counts = [int(r.layout.vision_counts()[0]) for r in results]
        # an adaptive count (PruMerge+'s outliers) may keep all: uniform relevance has none
        most = 576 if name in ADAPTIVE else 575
        assert all(0 < c <= most for c in counts) and counts == sorted(counts, reverse=True)
        assert (
            int((results[-1].layout.kind == lightkv.TokenKind.TEXT).sum()) == 14
        )  # text untouched


def test_get_preset_returns_fresh_pipelines_and_lists_names_when_unknown():
    a, b = get_preset("lightkv"), get_preset("lightkv")
    assert a == b and a is not b and a.partitioner is not b.partitioner
    with pytest.raises(ValueError, match=r"unknown preset 'lightk'.*lightkv, lightkv-qwen2_5_vl"):
        get_preset("lightk")
    with pytest.raises(ValueError, match="available presets"):
        get_preset_config("nope")
    cfg = get_preset_config("tome")
    cfg.name = "changed"
    assert PRESETS["tome"].config.name == "tome"


def test_lightkv_schedules_per_model():
    llava = get_preset("lightkv").scheduler
    assert llava == ExplicitSchedule(
        layers=(12, 18, 24), removal_ratios=(0.5,), windows_per_side=(4, 2, 1)
    )
    qwen = get_preset("lightkv-qwen2_5_vl").scheduler
    assert [(s.layer, s.windows_per_side, s.removal_ratio) for s in qwen.plan(28)] == [
        (12, 6, 0.5),
        (17, 4, 0.5),
        (22, 2, 0.5),
    ]
    assert get_preset("lightkv-paper").partitioner.name == "pseudo_square"


@pytest.mark.parametrize(
    "name, grid, depth, counts",
    [
        ("lightkv-paper", (24, 24), 32, [288, 145, 73]),  # the paper's LLaVA-1.5 counts
        (
            "lightkv-paper-qwen2_5_vl",
            (32, 32),
            28,
            [520, 260, 131],
        ),  # the reference Qwen2.5-VL counts
        ("lightkv", (24, 24), 32, [288, 144, 72]),
        ("divprune", (24, 24), 32, [128]),  # keep 128 of 576, exactly
        ("cdpruner", (24, 24), 32, [128]),
        ("dart", (24, 24), 32, [128]),
        ("scope", (24, 24), 32, [128]),
        ("mmtok", (24, 24), 32, [128]),
        ("lightkv-cover", (24, 24), 32, [128]),
        ("holov", (24, 24), 32, [128]),
    ],
)
def test_reference_token_counts(name, grid, depth, counts):
    layout = llava_layout(grid)
    hidden = torch.randn(1, layout.seq_len, 16, generator=torch.Generator().manual_seed(0))
    keys = torch.randn(
        1, layout.seq_len, 2, 8, generator=torch.Generator().manual_seed(1)
    )  # for DART's pivots
    results = get_preset(name).run(hidden, layout, num_layers=depth, key_states=keys)
    assert [int(r.layout.vision_counts()[0]) for r in results] == counts


def test_fastv_drops_the_least_attended_half_after_layer_1():
    pipe = get_preset("fastv")
    assert [s.layer for s in pipe.scheduler.plan(32)] == [1]
    assert pipe.relevance.name == "last_token" and pipe.scorer is None and not pipe.passer.merges
    layout = llava_layout((4, 6))
    hidden = torch.randn(1, layout.seq_len, 8)
    relevance = torch.rand(1, layout.seq_len)
    (res,) = pipe.run(hidden, layout, num_layers=32, relevance=relevance)
    vision = layout.vision_mask[0].nonzero().flatten()
    top = vision[relevance[0, vision].argsort(descending=True)[:12]]
    kept = res.layout.origin[0][res.layout.vision_mask[0]]
    assert sorted(kept.tolist()) == sorted(top.tolist())
    assert torch.equal(
        res.hidden[0][res.layout.vision_mask[0]], hidden[0, kept]
    )  # dropped, not merged


def test_pdrop_is_a_pyramid_of_attention_drops():
    pipe = get_preset("pdrop")
    assert [s.layer for s in pipe.scheduler.plan(32)] == [7, 15, 23]
    layout = llava_layout()
    hidden = torch.randn(1, layout.seq_len, 8)
    relevance = torch.rand(1, layout.seq_len)
    results = pipe.run(hidden, layout, num_layers=32, relevance=relevance)
    assert [int(r.layout.vision_counts()[0]) for r in results] == [288, 144, 72]
    vision = layout.vision_mask[0].nonzero().flatten()
    final = results[-1].layout.origin[0][results[-1].layout.vision_mask[0]]
    top = vision[relevance[0, vision].argsort(descending=True)[:72]]
    assert sorted(final.tolist()) == sorted(top.tolist())
    assert get_preset_config("pdrop").average_kept_fraction(32) == pytest.approx(
        (8 + 8 * 0.5 + 8 * 0.25 + 8 * 0.125) / 32
    )


@pytest.mark.parametrize("grid", [(24, 24), (5, 7), (3, 2)])
def test_pool_is_2x2_average_pooling(grid):
    h, w = grid
    layout = llava_layout(grid, before=3, after=2)
    hidden = torch.randn(1, layout.seq_len, 6, dtype=torch.float64)
    (res,) = get_preset("pool").run(hidden, layout, num_layers=32)
    image = hidden[0, 3 : 3 + h * w].reshape(h, w, 6).permute(2, 0, 1).unsqueeze(0)
    pooled = F.avg_pool2d(
        image, kernel_size=2, stride=2, ceil_mode=True
    )  # partial windows: mean of what is there
    expected = pooled[0].permute(1, 2, 0).reshape(-1, 6)
    got = res.hidden[0][res.layout.vision_mask[0]]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(
        res.layout.coords[0][res.layout.vision_mask[0]] % 2,
        torch.zeros_like(expected[:, :2], dtype=torch.long),
    )
    assert torch.equal(res.hidden[0, :3], hidden[0, :3]) and torch.equal(
        res.hidden[0, -2:], hidden[0, -2:]
    )


def test_pool_on_images_smaller_than_a_window():
    segs = [ImageSegment(row=0, offset=1, grid=(1, 3)), ImageSegment(row=0, offset=5, grid=(1, 1))]
    layout = VisionLayout.from_segments(1, 7, segs)
    hidden = torch.randn(1, 7, 4, dtype=torch.float64)
    (res,) = get_preset("pool").run(hidden, layout, num_layers=32)
    vis = res.hidden[0][res.layout.vision_mask[0]]
    torch.testing.assert_close(
        vis, torch.stack([hidden[0, 1:3].mean(0), hidden[0, 3], hidden[0, 5]])
    )


def test_random_preset_is_deterministic():
    layout = llava_layout()
    hidden = torch.randn(1, layout.seq_len, 8)
    a = get_preset("random").run(hidden, layout, num_layers=32)
    b = get_preset("random").run(hidden, layout, num_layers=32)
    assert all(torch.equal(x.kept_index, y.kept_index) for x, y in zip(a, b))


# ---------------------------------------------------------------------------- new partitioners
def test_anchor_partitioner_has_one_destination_per_window():
    layout = llava_layout((5, 7))
    part = AnchorPartitioner().partition(StageInputs.of(layout, window_size=(2, 2)))
    inside = part.window >= 0
    dst = inside & ~part.is_src
    n_windows = int(part.window.max()) + 1
    assert int(dst.sum()) == n_windows == 3 * 4
    coords = layout.coords[dst]
    assert torch.equal(coords % 2, torch.zeros_like(coords))


def test_strided_partitioner_matches_a_stride_lattice():
    layout = llava_layout((5, 7))
    part = StridedPartitioner(stride=(2, 3)).partition(StageInputs.of(layout, windows_per_side=1))
    dst = (part.window >= 0) & ~part.is_src
    got = sorted(tuple(c) for c in layout.coords[dst].tolist())
    assert got == [(r, c) for r in (0, 2) for c in (0, 3)]  # rows < 4, cols < 6 (full blocks only)
    assert int(part.window.max()) == 0  # one window per image
    with pytest.raises(ValueError, match="stride must be two positive integers"):
        StridedPartitioner(stride=(0, 2))


# ---------------------------------------------------------------------------- schema basics
def test_shorthand_scalars_and_defaults():
    cfg = PipelineConfig.from_dict(
        {
            "name": "x",
            "schedule": {"layers": 3, "removal_ratios": 0.25, "window_size": [2, 3]},
            "scorer": "l2",
        }
    )
    assert (
        cfg.schedule.layers == [3]
        and cfg.schedule.removal_ratios == [0.25]
        and cfg.schedule.window_size == [(2, 3)]
    )
    assert cfg.scorer == PolicySpec(name="l2")
    pipe = cfg.build()
    assert isinstance(pipe.scorer, L2Divergence)
    assert pipe.scheduler.plan(8)[0].window_size == (2, 3)
    default = PipelineConfig()
    assert default.build() == Pipeline(name="custom")  # the schema's defaults are the Pipeline's


def test_params_are_coerced_to_the_policy_types_and_stored_plain():
    text = (
        "name: x\nschedule: {layers: [2], removal_ratios: [0.5]}\n"
        "scorer: {name: cosine, params: {eps: 1e-6}}\n"
    )
    cfg = PipelineConfig.from_yaml_text(
        text
    )  # PyYAML reads 1e-6 as a string; the policy wants a float
    assert cfg.scorer.params == {"eps": 1e-6}
    assert cfg.build().scorer == CosineDivergence(eps=1e-6)
    cfg = PipelineConfig.from_dict(
        {"partitioner": {"name": "strided", "params": {"stride": (1, 2)}}}
    )
    assert cfg.partitioner.params == {"stride": [1, 2]}
    assert cfg.build().partitioner == StridedPartitioner(stride=(1, 2))
    assert PipelineConfig.from_yaml_text(cfg.to_yaml()) == cfg


def test_kept_fraction_schedule_for_any_depth():
    cfg = PipelineConfig.from_dict({"schedule": {"kept_fraction": 0.5}})
    assert isinstance(cfg.build().scheduler, KeptFractionSchedule)
    for depth in (24, 32, 40, 80):
        stages = cfg.validate_for_model(depth)
        assert len(stages) == 3 and [s.windows_per_side for s in stages] == [4, 2, 1]
        assert cfg.average_kept_fraction(depth) == pytest.approx(0.5, abs=1e-4)
    custom = PipelineConfig.from_dict(
        {"schedule": {"kept_fraction": 0.6, "relative_layers": [0.5, 0.75]}}
    )
    assert [s.windows_per_side for s in custom.validate_for_model(32)] == [1, 1]
    # at 16/24 even ratio 0.5 keeps 71%: both stages move 5 layers earlier to reach 60%
    assert [s.layer for s in custom.validate_for_model(32)] == [11, 19]
    assert custom.average_kept_fraction(32) == pytest.approx(0.6, abs=1e-4)
    assert config_from_pipeline(custom.build()) == custom


def test_registered_scheduler_form():
    cfg = PipelineConfig.from_dict(
        {"schedule": {"name": "explicit", "params": {"layers": [4, 8], "windows_per_side": [2, 1]}}}
    )
    assert [s.layer for s in cfg.validate_for_model(16)] == [4, 8]
    assert PipelineConfig.from_yaml_text(cfg.to_yaml()) == cfg


def test_stage_overrides():
    cfg = PipelineConfig.from_dict(
        {"stage_overrides": {2: {"scorer": {"name": "l2"}, "partitioner": "global"}}, "name": "o"}
    )
    assert list(cfg.stage_overrides[2]) == ["partitioner", "scorer"]  # canonical order
    stages = cfg.build().stages(32)
    assert isinstance(stages[2].scorer, L2Divergence) and isinstance(
        stages[2].partitioner, GlobalPartitioner
    )
    assert isinstance(stages[0].scorer, CosineDivergence)
    text = cfg.to_yaml()
    assert "stage_overrides:\n  2: {partitioner: global, scorer: l2}\n" in text
    assert PipelineConfig.from_yaml_text(text) == cfg
    assert config_from_pipeline(cfg.build()) == cfg


def test_yaml_files(tmp_path):
    path = tmp_path / "mine.yaml"
    cfg = get_preset_config("lightkv")
    cfg.name = "mine"
    cfg.to_yaml(path)
    assert PipelineConfig.from_yaml(path) == cfg
    assert pipeline_from_yaml(path) == cfg.build()
    assert load_config(str(path)) == cfg and load_config("lightkv") == PRESETS["lightkv"].config
    with pytest.raises(FileNotFoundError, match="missing.yaml: does not exist"):
        PipelineConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(
        ValueError, match=r"no preset or file named 'lightkvv'; did you mean 'lightkv'\?; presets: "
    ):
        load_config("lightkvv")


# ---------------------------------------------------------------------------- error messages
def _error(data, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_dict(data, **kw)
    return info.value


def test_unknown_policy_name_lists_the_registered_ones():
    err = _error({"partitioner": "gird"}, source="my.yaml")
    msg = problems(err)["partitioner.name"]
    assert "unknown partitioner 'gird'" in msg
    assert "registered partitioners: " + ", ".join(FAMILIES["partitioner"].registered()) in msg
    assert "did you mean 'grid'?" in msg
    assert str(err).startswith("my.yaml: partitioner.name: unknown partitioner 'gird'")
    err = _error({"stage_overrides": {1: {"pruner": "smallest"}}})
    pruners = ", ".join(FAMILIES["pruner"].registered())
    assert "registered pruners: " + pruners in problems(err)["stage_overrides.1.pruner.name"]


def test_bad_parameters_name_the_field_value_and_allowed():
    msg = problems(_error({"partitioner": {"name": "grid", "params": {"splitt": "parity"}}}))[
        "partitioner.params.splitt"
    ]
    assert (
        "has no parameter 'splitt' (did you mean 'split'?); its parameters are: bands, "
        "min_kept_per_window, min_tokens_per_window, seed, split, src_parity" in msg
    )
    msg = problems(_error({"partitioner": {"name": "grid", "params": {"split": "zigzag"}}}))[
        "partitioner.params.split"
    ]
    assert "'parity', 'checkerboard', 'random' or 'all_src'" in msg and "'zigzag'" in msg
    msg = problems(_error({"scorer": {"name": "cosine", "params": {"eps": "abc"}}}))[
        "scorer.params.eps"
    ]
    assert "valid number" in msg and "'abc'" in msg


@pytest.mark.parametrize(
    "schedule, where, fragment",
    [
        (
            {"layers": [12, 18], "removal_ratios": [0.5, 1.0]},
            "schedule.removal_ratios.1",
            "removal ratio must be in [0, 1)",
        ),
        ({"layers": [12], "removal_ratios": [-0.1]}, "schedule.removal_ratios.0", "got -0.1"),
        (
            {"layers": [12, 12], "removal_ratios": [0.5]},
            "schedule.layers.1",
            "strictly increasing, got [12, 12]",
        ),
        (
            {"layers": [-1], "removal_ratios": [0.5]},
            "schedule.layers.0",
            "0-based and must be >= 0, got -1",
        ),
        (
            {"layers": [3, 4], "removal_ratios": [0.5, 0.5, 0.5]},
            "schedule.removal_ratios",
            "3 entries for 2 layers; give 1 or 2",
        ),
        ({"layers": [3]}, "schedule.removal_ratios", "an explicit schedule needs removal_ratios"),
        (
            {
                "layers": [3],
                "removal_ratios": [0.5],
                "windows_per_side": [2],
                "window_size": [[2, 2]],
            },
            "schedule.window_size",
            "not both",
        ),
        (
            {"layers": [3], "removal_ratios": [0.5], "windows_per_side": [0]},
            "schedule.windows_per_side.0",
            "positive integer, got 0",
        ),
        (
            {"layers": [1], "removal_ratios": [0.5], "kept_fraction": 0.5},
            "schedule",
            "got layers and kept_fraction",
        ),
        ({"removal_ratios": [0.5]}, "schedule", "give exactly one of layers"),
        (
            {"kept_fraction": 0.5, "removal_ratios": [0.5]},
            "schedule.removal_ratios",
            "cannot be combined with kept_fraction",
        ),
        ({"kept_fraction": 0.0}, "schedule.kept_fraction", "must be in (0, 1], got 0.0"),
        (
            {"kept_fraction": 0.5, "relative_layers": [1.5]},
            "schedule.relative_layers.0",
            "in [0, 1], got 1.5",
        ),
        (
            {"layer": [1], "removal_ratios": [0.5]},
            "schedule.layer",
            "unknown field 'layer'; did you mean 'layers'?",
        ),
        (
            {"layers": [True], "removal_ratios": [0.5]},
            "schedule.layers.0",
            "valid integer, got True",
        ),
        (
            {"name": "nope"},
            "schedule.name",
            "unknown scheduler 'nope'; registered schedulers: budget, cache, explicit, "
            "kept_fraction, pre_llm, pre_llm_adaptive, pre_llm_then_layer, scaled",
        ),
    ],
)
def test_schedule_errors(schedule, where, fragment):
    msg = problems(_error({"schedule": schedule}))
    assert where in msg, msg
    assert fragment in msg[where]


def test_structural_errors():
    msg = problems(_error({"schedul": {}}))["schedul"]
    assert (
        "unknown field 'schedul'; did you mean 'schedule'?" in msg
        and "allowed: name, summary" in msg
    )
    assert (
        "registered policy name or {name: ..., params: {...}}, got None"
        in problems(_error({"partitioner": None}))["partitioner"]
    )
    assert "needs an edge scorer" in problems(_error({"scorer": None}))["scorer"]
    msg = problems(_error({"stage_overrides": {0: {"scorr": "l2"}}}))["stage_overrides.0.scorr"]
    assert "unknown field 'scorr'; did you mean 'scorer'?" in msg
    msg = problems(_error({"stage_overrides": {5: {"scorer": "l2"}}}))["stage_overrides.5"]
    assert "beyond the schedule, which has 3 stage(s)" in msg
    msg = problems(_error({"scorer": {"name": "cosine", "params": {"eps": math.inf}}}))[
        "scorer.params.eps"
    ]
    assert "finite" in msg
    fastv_like = {"scorer": None, "pruner": "lowest_relevance", "passer": "relevance_mean"}
    assert "merges tokens and needs an edge scorer" in problems(_error(fastv_like))["scorer"]


def test_build_checks_edited_configs_again():
    cfg = get_preset_config("lightkv")
    cfg.partitioner = PolicySpec(name="gird")
    with pytest.raises(ConfigError, match="partitioner.name: unknown partitioner 'gird'"):
        cfg.build()


def test_summary_is_one_line():
    assert "one line" in problems(_error({"summary": "a\nb"}))["summary"]


def test_layer_beyond_the_model_depth_names_the_depth():
    cfg = get_preset_config("lightkv-qwen2_5_vl")
    with pytest.raises(ConfigError) as info:
        cfg.validate_for_model(20)
    msg = problems(info.value)["schedule.layers"]
    assert "after layer 22, but the model has only 20 layers (0..19)" in msg
    assert [s.layer for s in cfg.validate_for_model(23)] == [12, 17, 22]
    with pytest.raises(ConfigError, match="positive integer"):
        cfg.validate_for_model(0)
    over = PipelineConfig.from_dict(
        {"schedule": {"kept_fraction": 0.8}, "stage_overrides": {2: {"scorer": "l2"}}}
    )
    with pytest.raises(
        ConfigError,
        match=r"stage 2 does not exist: on a model with 2 layers the schedule has 1 stage\(s\)",
    ):
        over.validate_for_model(2)


def test_yaml_level_errors():
    with pytest.raises(
        ConfigError,
        match=r"f.yaml: not valid YAML: line 3, column 1: (did not find )?expected ',' or ']'",
    ):
        PipelineConfig.from_yaml_text("name: x\nschedule: [1\n", source="f.yaml")
    with pytest.raises(ConfigError, match=r"duplicate key 'name' \(line 2, column 1\)"):
        PipelineConfig.from_yaml_text("name: x\nname: y\n")
    with pytest.raises(ConfigError, match="must be a mapping of fields, got an empty document"):
        PipelineConfig.from_yaml_text("")
    with pytest.raises(ConfigError, match="got a list"):
        PipelineConfig.from_yaml_text("- 1\n")


def test_unregistered_policy_objects_cannot_be_described():
    class Local(GlobalPartitioner):  # a subclass that was never registered
        pass

    pipe = Pipeline(partitioner=Local())
    with pytest.raises(ConfigError, match="Local is not a registered policy"):
        config_from_pipeline(pipe)
    # the class default (4, 2, 1) fits three layers only: refused at construction, naming it
    with pytest.raises(
        ValueError, match=r"windows_per_side defaults to \(4, 2, 1\), one entry per default layer"
    ):
        ExplicitSchedule(layers=(2,), removal_ratios=(0.75,))
    assert ExplicitSchedule(layers=(2,), window_size=((2, 2),)).windows_per_side is None


# ---------------------------------------------------------------------------- JSON Schema
def test_json_schema_export():
    schema = json_schema()
    assert schema["$schema"].endswith("2020-12/schema")
    assert set(schema["properties"]) == set(PipelineConfig.model_fields)
    part = schema["$defs"]["PartitionerSpec"]
    assert part["anyOf"][0]["enum"] == list(FAMILIES["partitioner"].registered())
    grid = next(v for v in part["anyOf"][1]["oneOf"] if v["title"] == "grid")
    assert grid["properties"]["params"]["properties"]["split"]["enum"] == [
        "parity",
        "checkerboard",
        "random",
        "all_src",
    ]
    assert "PolicySpec" not in str(schema)


def test_json_schema_accepts_presets_and_rejects_bad_files():
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json_schema())
    jsonschema.Draft202012Validator.check_schema(validator.schema)
    for name, preset in PRESETS.items():
        assert not list(validator.iter_errors(preset.config.to_dict())), name
    bad = [
        {"partitioner": "gird"},
        {"scorer": {"name": "cosine", "params": {"features": "values"}}},
        {"schedule": {"layers": [1], "removal_ratios": [0.5], "bogus": 1}},
        {"stage_overrides": {"0": {"scorr": "l2"}}},
        {"mode": {"name": "h2o", "params": {"budgett": 0.5}}},
        {"mode": "layer"},  # runs stages; not a pipeline's own mode
    ]
    for data in bad:
        assert list(validator.iter_errors(data)), data
    assert not list(validator.iter_errors({"mode": {"name": "h2o", "params": {"budget": 0.3}}}))


# ---------------------------------------------------------------------------- modes
def test_a_mode_block_alone_plans_no_stage_and_lists_no_policy():
    """``mode:`` without ``schedule:`` is a pipeline of the mode alone: no stage, no policy in
    its YAML, the settings on the mode; the text round-trips."""
    from lightkv.adapters.modes.h2o import H2OMode

    cfg = PipelineConfig.from_yaml_text("mode: {name: h2o, params: {budget: 0.25, tokens: all}}")
    pipe = cfg.build()
    assert pipe.scheduler is None and pipe.stages(8) == []
    assert pipe.mode == H2OMode(budget=0.25, tokens="all")
    assert pipe.modes(8) == ["h2o"] and pipe.target_kept_fraction(8) == 0.25
    data = cfg.to_dict()
    assert data == {
        "name": "custom",
        "mode": {"name": "h2o", "params": {"budget": 0.25, "tokens": "all"}},
    }
    assert PipelineConfig.from_dict(data) == cfg
    assert config_from_pipeline(pipe) == cfg
    assert cfg.validate_for_model(8) == []
    with pytest.raises(ConfigError, match="evicts on layer 9, but the model has only 8"):
        PipelineConfig.from_yaml_text(
            "mode: {name: h2o, params: {layers: [9]}}"
        ).validate_for_model(8)


@pytest.mark.parametrize(
    "data, where, fragment",
    [
        (
            {"mode": "h2o", "pruner": "random"},
            "pruner",
            "plans no stage (no schedule), so 'pruner' would never run",
        ),
        (
            {"mode": "h2o", "stage_overrides": {0: {"pruner": "random"}}},
            "stage_overrides",
            "would never run",
        ),
        ({"schedule": None}, "schedule", "no mode is given, so the pipeline would do nothing"),
        ({"mode": "layer"}, "mode.name", "cannot hold it as its own"),
        ({"mode": "sequence"}, "mode.name", "cannot hold it as its own"),
        (
            {"mode": {"name": "h2o", "params": {"budgett": 1}}},
            "mode.params.budgett",
            "its parameters are: budget, layers, recent_share, tokens",
        ),
        ({"mode": {"name": "h2o", "params": {"budget": 0}}}, "mode.params", "budget must be > 0"),
        ({"mode": "h2O"}, "mode.name", "unknown mode 'h2O'"),
        (
            {"schedule": {"name": "h2o", "params": {"budget": 0.3}}},
            "schedule",
            "write `mode: {name: h2o, params: {budget: 0.3}}`",
        ),
    ],
)
def test_mode_errors(data, where, fragment):
    msg = problems(_error(data))
    assert where in msg, msg
    assert fragment in msg[where]


def test_a_mode_beside_stages():
    """A pipeline's own mode may run beside its stages (both listed, the stages' policies
    kept); no single promise is claimed when both would act. H2O, which works on the
    uncompressed prompt, is refused beside stages in one line."""
    from dataclasses import dataclass

    from lightkv.adapters.modes.h2o import H2OMode
    from lightkv.policies import Mode

    @dataclass
    class Promising(Mode):
        keep: float | None = None

        def target_kept_fraction(self, num_layers):
            return self.keep

    Mode.register("promising")(Promising)
    try:
        text = "schedule: {layers: [1], removal_ratios: 0.5}\nmode: promising"
        cfg = PipelineConfig.from_yaml_text(text)
        pipe = cfg.build()
        assert [s.spec.layer for s in pipe.stages(4)] == [1]
        assert pipe.modes(4) == ["promising", "layer"]
        assert "schedule" in cfg.to_dict() and "pruner" in cfg.to_dict()
        assert PipelineConfig.from_yaml_text(cfg.to_yaml()) == cfg
        assert pipe.target_kept_fraction(4) == pytest.approx(0.75)  # the stages' alone
        # each promise counts its own work only: no single number is claimed for both
        assert pipe.with_mode(Promising(keep=0.5)).target_kept_fraction(4) is None
        assert (
            pipe.with_scheduler(None).with_mode(Promising(keep=0.5)).target_kept_fraction(4) == 0.5
        )
    finally:
        del Mode._registry["promising"]
    with pytest.raises(ConfigError, match="mode: mode 'h2o' works on the uncompressed prompt"):
        PipelineConfig.from_yaml_text("schedule: {layers: [1], removal_ratios: 0.5}\nmode: h2o")
    with pytest.raises(ValueError, match="does not run beside stages: give it no scheduler"):
        lightkv.Pipeline(mode=H2OMode())


def test_proportional_attention_key():
    """Off by default and in every preset but lightkv-cover's (its merge before the LLM relies
    on it); ``proportional_attention: true`` round-trips, is written only when on, and accepts
    only a boolean (a string must not switch it on)."""
    assert (
        PipelineConfig().proportional_attention is False
        and Pipeline().proportional_attention is False
    )
    on = {"lightkv-cover", "era"}
    for name, preset in PRESETS.items():
        assert preset.config.build().proportional_attention is (name in on), name
        assert ("proportional_attention" in preset.config.to_dict()) is (name in on), name
    cfg = PipelineConfig.from_yaml_text(
        "name: x\nschedule: {layers: [2], removal_ratios: [0.5]}\nproportional_attention: true\n"
    )
    pipe = cfg.build()
    assert pipe.proportional_attention is True
    assert "proportional_attention: true" in cfg.to_yaml()
    assert PipelineConfig.from_yaml_text(cfg.to_yaml()) == cfg == config_from_pipeline(pipe)
    assert config_from_pipeline(
        pipe.with_scheduler(ExplicitSchedule(layers=(3,), windows_per_side=(1,)))
    ).proportional_attention
    assert "proportional_attention: true" in lightkv.to_yaml(pipe)
    for bad in ('"yes"', "1", "[true]"):
        with pytest.raises(ConfigError, match="proportional_attention"):
            PipelineConfig.from_yaml_text(f"proportional_attention: {bad}\n")
    with pytest.raises(TypeError, match="proportional_attention must be True or False"):
        Pipeline(proportional_attention="yes")
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json_schema())
    assert json_schema()["properties"]["proportional_attention"]["type"] == "boolean"
    assert not list(validator.iter_errors(cfg.to_dict()))
    assert list(validator.iter_errors({"proportional_attention": "yes"}))


# ---------------------------------------------------------------------------- property: round trips
_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=200)


@st.composite
def schedules(draw):
    form = draw(st.sampled_from(["layers", "kept_fraction", "name"]))
    if form == "layers":
        layers = sorted(draw(st.sets(st.integers(0, 40), min_size=1, max_size=4)))
        n = len(layers)
        count = st.sampled_from(sorted({1, n}))
        ratios = draw(
            st.lists(st.floats(0, 0.99, allow_nan=False), min_size=1, max_size=1).filter(
                lambda _: True
            )
        )
        ratios = ratios * draw(count) if len(ratios) == 1 else ratios
        data = {"layers": layers, "removal_ratios": ratios[:n] if len(ratios) > 1 else ratios}
        kind = draw(st.sampled_from(["none", "wps", "size"]))
        if kind == "wps":
            data["windows_per_side"] = draw(
                st.lists(st.integers(1, 8), min_size=1, max_size=1)
            ) * draw(count)
        elif kind == "size":
            data["window_size"] = [[draw(st.integers(1, 6)), draw(st.integers(1, 6))]] * draw(count)
        return data
    if form == "kept_fraction":
        data = {"kept_fraction": draw(st.floats(0.01, 1.0))}
        if draw(st.booleans()):
            data["relative_layers"] = draw(st.lists(st.floats(0, 1), min_size=1, max_size=3))
        return data
    return {
        "name": "explicit",
        "params": {
            "layers": [draw(st.integers(0, 5))],
            "removal_ratios": [0.5],
            "windows_per_side": [2],
        },
    }


@settings(max_examples=30)
@given(
    schedule=schedules(),
    name=_text,
    description=_text,
    scorer=st.sampled_from(
        [
            None,
            "cosine",
            {"name": "l2"},
            {"name": "cosine", "params": {"features": "key_states", "eps": 1e-9}},
        ]
    ),
    partitioner=st.sampled_from(
        [
            "grid",
            {"name": "grid", "params": {"split": "checkerboard", "src_parity": 1}},
            {"name": "strided", "params": {"stride": [2, 1]}},
            "anchor",
        ]
    ),
)
def test_yaml_round_trip_property(schedule, name, description, scorer, partitioner):
    data = {
        "name": name,
        "description": description,
        "schedule": schedule,
        "partitioner": partitioner,
        "scorer": scorer,
    }
    if scorer is None:
        data.update(pruner="random", passer="drop")
    cfg = PipelineConfig.from_dict(data)
    text = cfg.to_yaml()
    again = PipelineConfig.from_yaml_text(text)
    assert again == cfg
    assert again.to_yaml() == text
    assert yaml.safe_load(text) == cfg.to_dict()
    assert config_from_pipeline(cfg.build()).build() == cfg.build()


def test_schedule_config_round_trips_scheduler_objects():
    for scheduler in [
        ExplicitSchedule(),
        ExplicitSchedule(
            layers=(3,), removal_ratios=(0.25,), windows_per_side=None, window_size=((2, 3),)
        ),
        KeptFractionSchedule(),
        KeptFractionSchedule(kept_fraction=0.3, relative_layers=(0.5,), windows_per_side=(2,)),
    ]:
        assert ScheduleConfig.from_scheduler(scheduler).build() == scheduler
