"""The fourth round of bad inputs (issue 40 items 3, 4, 5): each one a one-line error that
names the option and the value, before any work; no traceback, no silent accept."""

from __future__ import annotations

import math

import pytest

from lightkv.cli import main


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


# ----------------------------------------------------------------- item 5: one kept-fraction range
@pytest.mark.parametrize(
    "command", [["bench", "quality"], ["bench", "ablation"], ["bench", "efficiency", "--quick"]]
)
@pytest.mark.parametrize("value", ["1e-300", "0", "1.5", "nan", "-0.5"])
def test_every_benchmark_takes_kept_fractions_in_one_range(command, value, capsys):
    assert main([*command, "--kept-fractions", "0.5", value]) == 2
    line = _one_line(capsys)
    assert (
        line.startswith("lightkv: error: --kept-fractions takes kept fractions in [0.01, 1]")
        and value in line
    )


@pytest.mark.parametrize("command", [["bench", "quality"], ["bench", "ablation"]])
def test_one_is_a_kept_fraction_everywhere(command, monkeypatch, tmp_path, capsys):
    """(0, 1) in the ablation and efficiency benchmarks, (0, 1] in the quality one: now the
    same range; the run itself is cut short here, after the checks."""
    from lightkv_lab.bench import ablation, quality

    def stop(*a, **k):
        raise ValueError("stopped after the checks")

    monkeypatch.setattr(ablation, "run", stop)
    monkeypatch.setattr(quality, "run", stop)
    assert main([*command, "--kept-fractions", "1", "--out", str(tmp_path)]) == 2
    assert "stopped after the checks" in _one_line(capsys)


def test_the_range_is_one_function():
    from lightkv_lab.bench.budgets import MIN_KEPT_FRACTION, check_kept_fractions
    from lightkv_lab.bench.efficiency import BenchConfig

    assert check_kept_fractions([0.5, 1, 0.5, MIN_KEPT_FRACTION]) == (0.5, 1.0, MIN_KEPT_FRACTION)
    for bad in (0.0, 1e-300, 1.0001, math.nan):
        with pytest.raises(ValueError, match=r"in \[0.01, 1\]"):
            check_kept_fractions([bad])
    with pytest.raises(
        ValueError, match=r"budgets \(--kept-fractions\) takes kept fractions in \[0.01, 1\]"
    ):
        BenchConfig(budgets=(1e-300,))
    assert BenchConfig(budgets=(1.0, 0.5, 0.5)).budgets == (1.0, 0.5)


# ---------------------------------------------------------------------------- item 4: tracebacks
def test_a_kept_fraction_preset_goes_to_a_budget():
    """``bench efficiency --presets lightkv-budget --kept-fractions 0.5`` was a TypeError; the
    library's knob sets its target (issue 52: LightKV's own layers cannot go below 0.56 on
    12 layers, so the budget preset is the one that moves its stages there)."""
    from lightkv_lab.bench.budgets import knob_pipeline

    from lightkv.policies import KeptFractionSchedule, average_kept_fraction

    for target in (0.55, 0.4):
        pipe, how = knob_pipeline("lightkv-budget", 12, target)
        assert pipe.scheduler == KeptFractionSchedule(kept_fraction=target) and how == "scaled"
        assert average_kept_fraction(pipe.plan(12), 12) == pytest.approx(target, abs=1e-4)
    pipe, how = knob_pipeline("lightkv-budget", 12, 0.11)  # below its reach: at the nearest
    lowest = KeptFractionSchedule().lowest_kept_fraction(12)
    assert how == "nearest" and pipe.scheduler.kept_fraction == pytest.approx(lowest)
    light, light_how = knob_pipeline("lightkv", 12, 0.3)  # LightKV's layers, scaled from 32
    assert light_how == "nearest" and [s.layer for s in light.plan(12)] == [4, 6, 8]
    # at its limit (half of each window): layers 0-4 keep all, 5-6 1/2, 7-8 1/4, 9-11 1/8
    assert average_kept_fraction(light.plan(12), 12) == pytest.approx(6.875 / 12, abs=1e-4)


def test_a_schedule_that_cannot_take_a_budget_is_a_value_error_naming_the_preset():
    from lightkv_lab.bench import budgets

    import lightkv
    from lightkv.policies import Scheduler, StageSpec

    class Fixed(Scheduler):  # a plugin scheduler without the kept-fraction knob
        def plan(self, num_layers):
            return [StageSpec(0, 0.5, windows_per_side=1)]

    odd = lightkv.load("lightkv").with_scheduler(Fixed())
    odd.name = "odd"
    with pytest.raises(ValueError, match="preset 'odd' cannot be put at a kept fraction: .*knob"):
        budgets.knob_pipeline(odd, 12, 0.5)


def test_the_ablation_table_of_a_short_run_that_missed_question_types():
    """``bench ablation --episodes 2`` ended in ``KeyError: 'exists'`` after the whole run
    (no .md, no .png): a type the run never asked shows as "-"."""
    from lightkv_lab.bench.ablation import markdown_table
    from lightkv_lab.bench.quality_report import detail_accuracy

    row = {
        "method": "tome",
        "target": 0.55,
        "kept_fraction": 0.56,
        "accuracy": {"what": 1.0, "overall": 1.0},
        "kl": {"overall": 1e-6},
    }
    model = {
        "name": "digitgrid",
        "task": "digitgrid",
        "vision_tokens": 64,
        "layers": 4,
        "qtypes": ["what", "exists"],
        "detail_qtypes": ["what", "exists"],
        "uncompressed": {**row, "method": "uncompressed"},
        "rows": [row],
    }
    md = markdown_table({"config": {"episodes": 2, "targets": [0.55]}, "models": [model]})
    assert "| tome | 0.560 | 1.000 | - |" in md and "exists -" in md
    assert detail_accuracy(row, model) == 1.0
    assert math.isnan(detail_accuracy({"accuracy": {}}, model))


@pytest.mark.parametrize(
    "frames, message",
    [
        (10**30, r"frames must be an integer in \[0, 65536\]"),
        (True, "valid integer, got True"),
    ],
)
def test_spatiotemporal_frames_out_of_range_or_a_bool(frames, message):
    from lightkv.config import ConfigError, PipelineConfig

    with pytest.raises(ConfigError, match=message):
        PipelineConfig.from_dict(
            {
                "name": "x",
                "schedule": {"layers": [1], "removal_ratios": [0.5]},
                "partitioner": {"name": "spatiotemporal", "params": {"frames": frames}},
            }
        )


def test_a_layer_index_past_any_decoder_is_refused():
    from lightkv.config import ConfigError, PipelineConfig
    from lightkv.policies import StageSpec

    with pytest.raises(
        ValueError, match=r"stage layer must be an integer in \[0, 10000\), got 10+"
    ):
        StageSpec(10**23, 0.5, windows_per_side=1)
    with pytest.raises(ConfigError, match="stage layer must be an integer"):
        PipelineConfig.from_dict(
            {"name": "x", "schedule": {"layers": [10**23], "removal_ratios": [0.5]}}
        ).build()


def test_mode_and_policy_registration_refuse_no_name_and_the_base_class():
    from lightkv.adapters.modes import Mode
    from lightkv.policies import EdgeScorer

    for bad in (None, "", "  "):
        with pytest.raises(ValueError, match="non-empty name"):
            Mode.register(bad)
        with pytest.raises(ValueError, match="non-empty name"):
            EdgeScorer.register(bad)
    with pytest.raises(TypeError, match="not the family's base class"):
        Mode.register("x")(Mode)
    with pytest.raises(TypeError, match="not the family's base class"):
        EdgeScorer.register("x")(EdgeScorer)
    assert "x" not in Mode.registered() and "x" not in EdgeScorer.registered()
    with pytest.raises(ValueError, match="unknown mode 'nosuch'; registered modes: "):
        Mode.lookup("nosuch")  # the message still lists the names (a None key broke the sort)


# ---------------------------------------------------------------------------- item 3: list lengths
@pytest.mark.parametrize(
    "argv, option, limit",
    [
        (["bench", "quality", "--methods"], "--methods", 64),
        (["bench", "efficiency", "--quick", "--presets"], "--presets", 64),
        (["bench", "efficiency", "--quick", "--models"], "--models", 64),
        (["bench", "ablation", "--baselines"], "--baselines", 64),
    ],
)
def test_long_name_lists_are_refused_with_the_limit(argv, option, limit, capsys):
    assert main([*argv, *(f"name{i}" for i in range(100_000))]) == 2
    assert (
        _one_line(capsys)
        == f"lightkv: error: {option} takes at most {limit} distinct values, got 100,000"
    )


def test_long_kept_fraction_lists_are_refused_with_the_limit(capsys):
    values = [f"{0.5 + i / 1e6:.6f}" for i in range(100_000)]
    assert main(["bench", "efficiency", "--quick", "--kept-fractions", *values]) == 2
    assert (
        _one_line(capsys)
        == "lightkv: error: --kept-fractions takes at most 16 distinct values, got 100,000"
    )


def test_duplicates_are_merged_with_a_note(monkeypatch, tmp_path, capsys):
    from lightkv_lab.bench import quality

    seen = {}

    def stop(cfg, progress=True):
        seen["cfg"] = cfg
        raise ValueError("stopped")

    monkeypatch.setattr(quality, "run", stop)
    argv = [
        "bench",
        "quality",
        "--out",
        str(tmp_path),
        "--methods",
        *["lightkv"] * 50_000,
        "tome",
        "--kept-fractions",
        *["0.55"] * 50_000,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "lightkv: note: --methods: 49,999 repeated value(s) merged; running lightkv tome" in err
    assert "lightkv: note: --kept-fractions: 49,999 repeated value(s) merged; running 0.55" in err
    assert seen["cfg"].methods == ("lightkv", "tome") and seen["cfg"].targets == (0.55,)


def test_the_memory_child_reads_its_job_from_stdin(monkeypatch):
    """The child's configuration (with its lists) no longer goes on the command line, where
    long lists ended in ``OSError: Argument list too long``."""
    import subprocess

    from lightkv_lab.bench.efficiency import measure, shapes

    calls = {}

    class Done:
        returncode, stdout, stderr = 0, '{"peak_bytes": {}}\n', ""

    def fake_run(cmd, **kw):
        calls["cmd"], calls["input"] = cmd, kw.get("input")
        return Done()

    monkeypatch.setattr(subprocess, "run", fake_run)
    cfg = shapes.BenchConfig(presets=("lightkv",), budgets=tuple(0.5 + i / 100 for i in range(16)))
    measure.measure_peaks_in_child(shapes.MODELS["llava"], cfg, cfg.variants)
    assert calls["cmd"][-2:] == ["--memory-child", "-"] and '"budgets"' in calls["input"]
    assert max(len(a) for a in calls["cmd"]) < 200


def test_every_bad_stage_override_is_reported(tmp_path, capsys):
    """Three bad fields in stage overrides were reported as one (the first of the mapping)."""
    path = tmp_path / "three.yaml"
    path.write_text(
        "name: x\nschedule: {layers: [1, 2], removal_ratios: [0.5], windows_per_side: [2, 1]}\n"
        "stage_overrides: {0: {scorer: nosuch, pruner: nosuch}, 1: {passer: nosuch}}\n"
        "proportional_attention: 7\n"
    )
    assert main(["config", "validate", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    where = [line.split(f"{path}: ")[1].split(":")[0] for line in err]
    assert where == [
        "stage_overrides.0.scorer.name",
        "stage_overrides.0.pruner.name",
        "stage_overrides.1.passer.name",
        "proportional_attention",
    ], err


def test_a_directory_given_as_a_pipeline_is_called_a_directory(tmp_path, capsys):
    assert main(["config", "validate", str(tmp_path)]) == 2
    line = _one_line(capsys)
    assert "is a directory, not a file" in line and "not found" not in line
