"""Benchmarks say what they print (issue 52 item 6): intervals against a stated comparator
(``--baseline``) or a note why a cell is empty; the defaults ``--help`` names are the ones
the run uses; one progress bar with an ETA, quiet off a terminal or with ``--quiet``."""

from __future__ import annotations

import io
import re

import pytest

from lightkv.cli import build_parser, main


def _help(*path: str):
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if getattr(a, "choices", None) and name in a.choices)
        parser = sub.choices[name]
    return parser


def _default(parser, option: str) -> list[float]:
    """The numbers after ``default:`` in ``option``'s help line."""
    (action,) = [a for a in parser._actions if option in a.option_strings]
    found = re.search(r"\(default: ([-0-9. ]+)\)", action.help)
    assert found, f"{option} names no default in --help"
    return [float(v) for v in found.group(1).split()]


def test_the_defaults_help_names_are_the_runs():
    from lightkv_lab.bench.ablation import AblationConfig
    from lightkv_lab.bench.quality import AccuracyConfig

    quality, ablation = _help("bench", "quality"), _help("bench", "ablation")
    assert _default(quality, "--kept-fractions") == list(AccuracyConfig.targets)
    assert _default(quality, "--episodes") == [AccuracyConfig.episodes]
    assert _default(ablation, "--kept-fractions") == list(AblationConfig.targets)
    assert _default(ablation, "--episodes") == [AblationConfig.episodes]
    described = re.search(r"about ([0-9/]+)%", quality.description).group(1)
    assert [int(v) / 100 for v in described.split("/")] == list(AccuracyConfig.targets)


def _result(methods: list[str], baseline: str | None) -> dict:
    """A quality result of two methods at 55% as `lightkv_lab.bench.quality.run` builds it."""
    row = {
        "target": 0.55,
        "how": "scaled",
        "kept_fraction": 0.55,
        "kv_bytes_vision": 1024,
        "accuracy": {"what": 0.5, "overall": 0.5},
        "kl": {"what": 1e-3, "overall": 1e-3},
        "logp_drop": {"what": 0.1, "overall": 0.1},
    }
    rows = [{**row, "method": m} for m in methods]
    for r in rows:
        if baseline and r["method"] != baseline:
            r["vs_baseline"] = {
                "accuracy": {"what": [0.25, 0.0, 0.5], "overall": [0.25, 0.0, 0.5]},
                "kl": {"overall": [-1e-3, -2e-3, 0.0]},
            }
    return {
        "baseline": baseline,
        "rows": rows,
        "ablations": [],
        "qtypes": ["what"],
        "detail_qtypes": ["what"],
        "model": {"name": "m", "task": "t", "vision_tokens": 64, "layers": 4},
        "config": {"episodes": 8},
        "uncompressed": {**row, "method": "uncompressed", "target": 1.0, "kept_fraction": 1.0},
    }


def test_intervals_name_their_comparator_or_say_why_they_are_empty():
    from lightkv_lab.bench.quality_report import markdown_table

    md = markdown_table(_result(["lightkv-cover", "fastv"], "lightkv-cover"))
    assert "| lightkv-cover - this, what | lightkv-cover - this, KL |" in md
    assert "lightkv-cover (the comparator) minus the method" in md
    assert "| fastv | 100.0% (+25.0 [+0.0, +50.0]) |" in md
    assert "| lightkv-cover | 100.0% |" in md  # the comparator itself: no empty brackets
    md = markdown_table(_result(["fastv", "tome"], None))
    assert "no intervals: none of the methods is a lightkv method" in md
    assert "()" not in md and "| comparator - this, what |" in md


def test_the_comparator_defaults_to_the_first_lightkv_method_and_must_run():
    from lightkv_lab.bench.quality import AccuracyConfig, comparator

    assert comparator(AccuracyConfig(methods=("fastv", "lightkv-cover", "lightkv"))) == (
        "lightkv-cover"
    )
    assert comparator(AccuracyConfig(methods=("fastv", "tome"))) is None
    assert comparator(AccuracyConfig(methods=("fastv", "tome"), baseline="tome")) == "tome"
    with pytest.raises(ValueError, match="--baseline divprune is not among --methods"):
        comparator(AccuracyConfig(methods=("fastv",), baseline="divprune"))


def test_a_baseline_outside_the_methods_is_one_line_before_any_work(capsys, monkeypatch):
    from lightkv_lab.bench import quality

    monkeypatch.setattr(quality, "run", lambda *a, **k: pytest.fail("ran"))
    argv = ["bench", "quality", "--methods", "fastv", "--baseline", "tome", "--episodes", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "lightkv: error: --baseline tome is not among --methods (fastv): the intervals compare "
        "methods of one run"
    ]


def test_no_progress_was_renamed_quiet(capsys):
    assert main(["bench", "efficiency", "--quick", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lightkv: error: --no-progress was renamed; use --quiet"
    )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_bar_with_an_eta_on_a_terminal_and_none_off_it(monkeypatch):
    import sys

    from lightkv_lab.bench.progress import Progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file, CI: nothing
    with Progress(3, "quality") as quiet:
        quiet.step("fastv")
    assert quiet.bar is None and sys.stderr.getvalue() == ""
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with Progress(3, "quality", quiet=True) as told:  # --quiet
        told.step("fastv")
    assert told.bar is None and terminal.getvalue() == ""
    with Progress(3, "quality") as shown:
        for what in ("uncompressed", "fastv", "tome"):
            shown.step(what)
    text = terminal.getvalue()
    assert "quality" in text and "3/3" in text and "<" in text  # tqdm's elapsed<remaining
