"""The ``lightkv`` command line: output, exit codes, one-line errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest
import yaml

from lightkv.cli import main
from lightkv.config import PipelineConfig
from lightkv.policies import Partitioner
from lightkv.presets import PRESETS


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_reads_well(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for text in ("usage: lightkv", "presets", "config", "examples:", "exit status"):
        assert text in out
    code, out, _ = run(capsys, "config", "--help")
    assert code == 0 and all(a in out for a in ("show", "validate", "schema"))
    code, out, _ = run(capsys, "config", "validate", "--help")
    assert code == 0 and "--num-layers" in out and "--grid" in out


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("lightkv ")


def test_presets_lists_every_preset_with_its_summary(capsys):
    code, out, err = run(capsys, "presets")
    assert code == 0 and not err
    lines = out.splitlines()
    assert len(lines) == len(PRESETS)
    for line, (name, preset) in zip(lines, PRESETS.items()):
        assert line.split()[0] == name and line.endswith(preset.summary)
    code, out, _ = run(capsys, "presets", "--verbose")
    assert code == 0 and "Source: " in out and "PyramidDrop" in out


@pytest.mark.parametrize("name", ["lightkv", "fastv", "pool"])
def test_config_show_preset_prints_canonical_yaml(capsys, name):
    code, out, err = run(capsys, "config", "show", name)
    assert code == 0 and not err
    assert out == PRESETS[name].config.to_yaml()
    assert PipelineConfig.from_yaml_text(out) == PRESETS[name].config


def test_config_show_file_json_and_plan(capsys, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nschedule: {kept_fraction: 0.5}\nscorer: l2\n")
    code, out, _ = run(capsys, "config", "show", str(path), "--num-layers", "40")
    assert code == 0
    assert (
        "scorer: l2" in out
        and "# on a 40-layer model, 3 stage(s):" in out
        and "# vision KV kept" in out
    )
    assert yaml.safe_load(out)["name"] == "mine"  # the plan is YAML comments
    code, out, _ = run(capsys, "config", "show", str(path), "--format", "json")
    assert code == 0 and json.loads(out)["schedule"] == {"kept_fraction": 0.5}


def test_config_validate_ok(capsys, tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(PRESETS["lightkv-qwen2_5_vl"].config.to_yaml())
    code, out, err = run(
        capsys, "config", "validate", str(path), "--num-layers", "28", "--grid", "32x32"
    )
    assert code == 0 and not err
    assert out.splitlines()[0] == f"{path}: valid pipeline 'lightkv-qwen2_5_vl'"
    assert "stage 1: after layer 17, removal ratio 0.5, windows_per_side 4" in out
    assert "dry run on one 32x32 image: 1024 -> 520 -> 263 -> 132 vision tokens" in out
    code, out, _ = run(capsys, "config", "validate", "fastv")
    assert code == 0 and "(assumed; pass --num-layers" in out and "576 -> 288 vision tokens" in out


def test_config_validate_invalid_file_exit_1(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: bad\nschedule:\n  layers: [12, 18]\n  removal_ratios: [0.5, 1.5]\npartitioner: "
        "gird\n"
    )
    code, out, err = run(capsys, "config", "validate", str(path))
    assert code == 1 and not out
    lines = err.splitlines()
    assert lines == [
        f"lightkv: error: {path}: schedule.removal_ratios.1: removal ratio must be in [0, 1) (0 "
        "keeps every token), got 1.5",
        (
            f"lightkv: error: {path}: partitioner.name: unknown partitioner 'gird'; registered "
            "partitioners: " + ", ".join(Partitioner.registered()) + "; did you mean 'grid'?"
        ),
    ]


def test_config_validate_layer_beyond_depth_exit_1(capsys):
    code, _, err = run(capsys, "config", "validate", "lightkv", "--num-layers", "16")
    assert code == 1
    assert err.strip() == (
        "lightkv: error: lightkv: schedule.layers: the schedule compresses after layer 24, but the "
        "model has only 16 layers (0..15); use layers below 16 or a kept_fraction schedule"
    )


def test_config_validate_bad_yaml(capsys, tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: [x\n")
    code, _, err = run(capsys, "config", "validate", str(path))
    assert code == 1 and len(err.splitlines()) == 1 and "not valid YAML: line 2, column 1" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["config", "validate", "missing.yaml"], "lightkv: error: missing.yaml: does not exist"),
        (
            ["config", "show", "lightkvv"],
            "lightkv: error: no preset or file named 'lightkvv'; did you mean 'lightkv'?; "
            "presets: ",
        ),
        (
            ["config", "show", "no/such/dir.yaml"],
            "lightkv: error: no/such/dir.yaml: does not exist",
        ),
    ],
)
def test_usage_errors_are_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and err.startswith(message)
    assert "Traceback" not in err


def test_directory_is_not_a_file(capsys, tmp_path):
    code, _, err = run(
        capsys,
        "config",
        "validate",
        str(tmp_path / ""),
    )
    assert code == 2 and "is a directory, not a file" in err


@pytest.mark.parametrize(
    "argv", [["bogus"], ["config", "show"], ["config", "validate", "x.yaml", "--grid", "3y3"], []]
)
def test_bad_arguments_exit_2(capsys, argv):
    code, _, err = run(capsys, *argv)
    assert code == 2 and "usage: lightkv" in err and "Traceback" not in err


def test_config_schema(capsys):
    code, out, err = run(capsys, "config", "schema")
    assert code == 0 and not err
    schema = json.loads(out)
    assert schema["title"] == "lightkv pipeline" and "PartitionerSpec" in schema["$defs"]


def test_console_script_and_module_entry_point(tmp_path):
    scripts = metadata.entry_points(group="console_scripts", name="lightkv")
    assert [ep.value for ep in scripts] == ["lightkv.cli:main"]
    proc = subprocess.run(
        [sys.executable, "-m", "lightkv", "config", "show", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and not proc.stdout
    assert (
        proc.stderr.startswith("lightkv: error: no preset or file named 'nope'")
        and "Traceback" not in proc.stderr
    )


@pytest.mark.parametrize("preset", ["elasticcache", "h2o", "lightkv-pre-llm"])
def test_config_validate_accepts_every_mode(capsys, preset):
    """Regression (issue 27, item 10): ``config validate elasticcache`` (a shipped preset) exited
    1 because its dry run ran cache stages on hidden states."""
    code, out, err = run(capsys, "config", "validate", preset)
    assert code == 0 and not err, err
    if preset == "elasticcache":
        assert "stage 0: on layer 0's cache" in out
        assert "each of the 32 compressed layers' caches keeps 288 of 576 vision tokens" in out
    if preset == "lightkv-pre-llm":
        assert "stage 0: before layer 0 (pre-LLM)" in out
    if preset == "h2o":  # a mode alone: what it keeps, and no dry run without a model
        assert (
            "no stages; mode H2OMode(budget=0.5" in out
            and "kept on average over layers: 50.0%" in out
        )
        assert "no dry run: mode 'h2o' works on a model's cache" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["bench", "efficiency", "--repeats", "1000000000"], "--repeats: at most 100"),
        (["bench", "efficiency", "--layers", "100000"], "--layers: at most 80"),
        (["bench", "efficiency", "--heads", "5000"], "--heads: at most 128"),
        (["bench", "scaling", "--width", "1000000000"], "--width: at most 16,384"),
        (["bench", "scaling", "--sides", "24", "100000"], "--sides: at most 256"),
        (["bench", "kvquant", "--layers", "1000"], "--layers: at most 80"),
        (["bench", "quality", "--episodes", "1000000000"], "--episodes: at most 20,000"),
        (["bench", "quality", "--threads", "100000"], "--threads: at most"),
        (["bench", "ablation", "--episodes", "1000000000"], "--episodes: at most 20,000"),
        (["bench", "memory", "--lengths", "1000000000"], "--lengths: at most 65,536"),
        (["bench", "memory", "--memory-limit", "100000"], "--memory-limit: at most 4,096"),
    ],
)
def test_sizes_past_a_stated_limit_are_refused_up_front(capsys, argv, needle):
    """Regression (issue 27, items 6 and 9): huge sizes ran for minutes or ended in tracebacks."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and "Traceback" not in err
    assert needle in err.strip().splitlines()[-1]


def test_a_decoder_whose_weights_cannot_fit_is_refused_with_the_estimate(capsys, monkeypatch):
    monkeypatch.setattr("lightkv_lab.cli.bench.physical_memory", lambda: 16 * 2**30)
    code, out, err = run(
        capsys, "bench", "efficiency", "--width", "full", "--layers", "40", "--models", "llava"
    )
    assert code == 2 and not out
    assert err.strip() == (
        "lightkv: error: --layers 40 at --width full needs about 30.2 GiB of weights (0.75 GiB a "
        "layer) and this machine has 16.0 GiB: use --layers 16 or fewer"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "quality", "--episodes", "4"],
        ["bench", "scaling", "--quick"],
        ["bench", "kvquant"],
        ["bench", "efficiency", "--quick"],
        ["bench", "ablation", "--episodes", "4"],
        ["bench", "memory", "--quick"],
    ],
)
def test_an_unwritable_out_is_refused_before_any_work(capsys, tmp_path, command):
    """Regression (issue 27, item 7): a file or an unwritable --out failed after the whole run."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, out, err = run(capsys, *command, "--out", str(afile))
    assert (
        code == 2 and not out and err.strip() == f"lightkv: error: --out {afile}: not a directory"
    )


def test_a_full_disk_is_one_line(tmp_path):
    """Regression (issue 27, item 9): ``config schema > /dev/full`` ended in a traceback."""
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "lightkv", "config", "schema"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "lightkv: error: cannot write the output: No space left on device"


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """Regression (issue 27, item 8): Ctrl-C printed a KeyboardInterrupt traceback."""
    import signal
    import time

    # a test runner's worker may ignore SIGINT, and children inherit that: restore the default
    # so the child installs Python's own handler, as in a terminal
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lightkv",
            "bench",
            "quality",
            "--episodes",
            "2000",
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(
        15
    )  # past the imports and the model load (slower on a loaded machine): inside the run
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "lightkv: interrupted" and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_default_results_go_under_the_current_directory_outside_a_checkout(tmp_path):
    """Regression (issue 27, item 15): from a pip install, results went into site-packages."""
    from lightkv_lab.bench.paths import results_dir

    installed, here = tmp_path / "site-packages", tmp_path / "work"
    installed.mkdir()
    assert results_dir(root=installed, cwd=here) == here / "benchmarks" / "results"
    (installed / "pyproject.toml").write_text("")
    (installed / "benchmarks").mkdir()
    assert results_dir(root=installed, cwd=here) == installed / "benchmarks" / "results"


def test_a_too_shallow_bench_names_layers(capsys, tmp_path):
    """Regression (issue 27, item 12): ``bench kvquant --layers 2`` failed with a schedule error
    that did not name ``--layers``."""
    code, out, err = run(capsys, "bench", "kvquant", "--layers", "2", "--out", str(tmp_path))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "on a 2-layer decoder (--layers 2)" in err and "need at least 4 layers" in err


def test_an_empty_cache_layer_list_is_refused(capsys, tmp_path):
    """Regression (issue 27, item 12): ``layers: []`` in a cache schedule compressed nothing,
    silently."""
    path = tmp_path / "empty.yaml"
    path.write_text(
        "name: empty\nschedule:\n  name: cache\n  params: {layers: []}\npartitioner: grid\n"
        "scorer: cosine\npruner: divergence\npasser: size_mean\nrelevance: uniform\n"
    )
    code, out, err = run(capsys, "config", "validate", str(path))
    assert (
        code == 1
        and "schedule.params.layers: scheduler 'cache': layers is empty, so nothing would" in err
    )


@pytest.mark.parametrize(
    "argv, module, extra",
    [
        (["generate", "--max-new-tokens", "1"], "PIL", "pillow"),
        (["bench", "quality", "--episodes", "4"], "matplotlib", "matplotlib"),
        (["bench", "ablation", "--episodes", "4"], "matplotlib", "matplotlib"),
        (["bench", "efficiency", "--quick"], "matplotlib", "matplotlib"),
        (["bench", "scaling", "--quick"], "matplotlib", "matplotlib"),
        (["bench", "memory", "--quick"], "matplotlib", "matplotlib"),
    ],
)
def test_a_missing_extra_is_named_before_any_work(capsys, monkeypatch, argv, module, extra):
    """Regression (issue 27, item 14): from a pip install without extras, commands ran for
    minutes, then failed on an import (``generate``: a raw ImportError traceback)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a)
    )
    code, out, err = run(capsys, *argv)
    assert code == 2 and not out
    assert err.strip().startswith(f"lightkv: error: this command needs {module}")
    assert err.strip().endswith(f"which is not installed: pip install {extra}")


def test_huge_grids_and_windows_are_one_line_errors(capsys, tmp_path):
    """Regression (issue 27, item 9): ``--grid 100000x100000`` and ``windows_per_side >= 2^63``
    ended in tracebacks (an allocation failure, an int64 overflow)."""
    code, out, err = run(capsys, "config", "validate", "lightkv", "--grid", "100000x100000")
    assert code == 2 and "--grid: at most 1,048,576 tokens" in err and "Traceback" not in err
    path = tmp_path / "big.yaml"
    path.write_text(
        "name: big\nschedule:\n  layers: [1]\n  removal_ratios: [0.5]\n  windows_per_side: "
        "[9223372036854775808]\n"
    )
    code, out, err = run(capsys, "config", "validate", str(path))
    assert code == 1 and err.strip().endswith(
        "windows_per_side must be at most 65536 (no image side has more "
        "tokens), got 9223372036854775808"
    )


@pytest.mark.parametrize(
    "command, prog", [(["demo"], "lightkv demo"), (["stages-demo"], "lightkv stages-demo")]
)
def test_the_demos_refuse_an_unwritable_out_by_their_command_name(capsys, command, prog):
    """Regression (issue 27, items 7 and 12): as root, a permission check passed for /proc and
    the demos failed later; stages-demo's errors named ``python -m lightkv_lab.stages_demo``."""
    code, out, err = run(capsys, *command, "--out", "/proc/lightkv-nope")
    assert code == 2
    assert f"{prog}" in err and "--out /proc/lightkv-nope: cannot write there" in err
    assert "python -m lightkv_lab.stages_demo" not in err
