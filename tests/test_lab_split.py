"""The library without the laboratory: its commands and bundled models answer with one line
saying to install ``lightkv-lab`` (exit status 2); with it, they are found through entry points."""

from __future__ import annotations

import pytest

from lightkv import lab
from lightkv.cli import main


@pytest.fixture
def no_lab(monkeypatch):
    """The library as `pip install lightkv` alone leaves it: no entry points of the laboratory."""
    monkeypatch.setattr(lab, "_entries", lambda group: {})


@pytest.mark.parametrize(
    "argv",
    [
        ["demo"],
        ["demo", "--questions", "3"],
        ["stages-demo"],
        ["bench"],
        ["bench", "quality", "--episodes", "2"],
    ],
)
def test_lab_commands_without_the_lab_say_to_install_it(no_lab, capsys, argv):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"lightkv: error: `lightkv {argv[0]}` needs the laboratory (lightkv-lab), "
        "which is not installed: from a clone of the lightkv repository, pip install ./lab "
        "(no release is on PyPI yet)"
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["generate"],
        ["generate", "--model", "digitgrid"],
        ["generate", "--model", "symbolgrid", "--image", "x.png", "--prompt", "hi"],
    ],
)
def test_bundled_models_without_the_lab_say_to_install_it(no_lab, capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        len(err) == 1
        and "needs the laboratory (lightkv-lab)" in err[0]
        and "from a clone of the lightkv repository, pip install ./lab" in err[0]
    )


def test_the_library_commands_work_without_the_lab(no_lab, capsys):
    assert main(["presets"]) == 0
    assert "lightkv" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert (
        "needs the laboratory" in capsys.readouterr().out
    )  # the lab's commands are listed, with how to get them


def test_the_lab_registers_its_commands_and_models_under_their_own_names():
    assert set(lab.commands()) == set(lab.LAB_COMMANDS)
    assert lab.bundled_models() == sorted(lab.LAB_MODELS)
    for name in lab.LAB_MODELS:
        model = lab.bundled_model(name)
        assert (model.path / "config.json").is_file()
    assert lab.bundled_model("no-such-model") is None


def test_the_librarys_lists_of_lab_names_are_the_labs_declared_entry_points():
    """`lightkv.lab.LAB_COMMANDS` and `LAB_MODELS` are written out (they serve when the
    laboratory is absent, with no entry points to read): they must be what
    lab/pyproject.toml declares, in the same order."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads(
        (Path(__file__).resolve().parents[1] / "lab" / "pyproject.toml").read_text()
    )["project"]["entry-points"]
    assert tuple(declared[lab.COMMANDS_GROUP]) == lab.LAB_COMMANDS
    assert tuple(declared[lab.MODELS_GROUP]) == lab.LAB_MODELS


def test_a_broken_lab_entry_point_warns_and_the_command_says_to_install(monkeypatch, capsys):
    from importlib.metadata import EntryPoint

    broken = EntryPoint("demo", "lightkv_lab_missing.cli:add", lab.COMMANDS_GROUP)
    monkeypatch.setattr(
        lab, "_entries", lambda group: {"demo": broken} if group == lab.COMMANDS_GROUP else {}
    )
    assert main(["demo"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(
        "lightkv: warning: cannot load 'demo' of entry-point group lightkv.commands"
    )
    assert err[1].startswith("lightkv: error: `lightkv demo` needs the laboratory")
