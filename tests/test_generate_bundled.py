"""`lightkv generate` as a new user runs it (issue 40 item 6): the bundled Scenes model by
default, bundled models by name, a note when a bundled model is shown another image, and
a missing extra in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightkv.cli import main

pytest.importorskip("PIL")


def test_the_default_is_the_bundled_scenes_model_with_a_fitting_preset(capsys):
    code = main(["generate", "--json", "--repeats", "1", "--max-new-tokens", "3"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    assert data["model"].endswith("scenes-llava") and data["pipeline"] == "lightkv-budget"
    assert (
        data["example"]["image"] == "a held-out scenes image" and data["example"]["expected_answer"]
    )
    assert any("the default for this 12-layer decoder" in n for n in data["notes"])


@pytest.mark.parametrize("name", ["scenes", "symbolgrid"])
def test_bundled_models_by_name(name, capsys):
    """``--model scenes`` was taken for a hub id (a connection error after a minute)."""
    code = main(["generate", "--model", name, "--json", "--repeats", "1", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["model"].endswith(f"{name}-llava")


def test_a_bundled_model_shown_another_image_says_its_answers_mean_nothing(tmp_path, capsys):
    from PIL import Image

    photo = tmp_path / "photo.jpg"
    Image.new("RGB", (64, 48), (30, 140, 200)).save(photo)
    code = main(
        [
            "generate",
            "--image",
            str(photo),
            "--prompt",
            "What is this?",
            "--repeats",
            "1",
            "--max-new-tokens",
            "2",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    note = [
        i
        for i, line in enumerate(lines)
        if "its answers about any other image mean nothing" in line
    ]
    answer = [i for i, line in enumerate(lines) if line.startswith("answer (lightkv)")]
    assert len(note) == 1 and note[0] < answer[0]  # said before the answer, in one line


def test_a_missing_extra_is_one_line():
    """DigitGrid's images need scikit-learn (the demo extra): without it, one line, no traceback."""
    code = (
        "import sys; sys.modules['sklearn'] = None\n"
        "from lightkv.cli import main\n"
        "raise SystemExit(main(['generate', '--model', 'digitgrid', '--repeats', '1']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert err == [
        "lightkv: error: this command needs sklearn, which is not installed: pip install "
        "scikit-learn"
    ]
