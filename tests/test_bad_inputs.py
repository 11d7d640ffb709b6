"""Bad inputs and misuse meet one clear line, fast (issue 13, part B)."""

from __future__ import annotations

import io
import os
import time

import pytest

from lightkv.cli import main
from lightkv.config import MAX_CONFIG_BYTES, ConfigError, PipelineConfig
from lightkv.presets import load_config

VALID = "name: mine\nschedule: {layers: [1], removal_ratios: [0.5]}\n"


def _bomb(levels: int = 9, width: int = 9) -> str:
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    lines.append(f"name: *a{levels}")
    return "\n".join(lines) + "\n"


def _timed_error(target) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises((ConfigError, FileNotFoundError, ValueError)) as info:
        load_config(target)
    return str(info.value), time.perf_counter() - start


def _one_line(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return code, lines[0]


@pytest.mark.parametrize(
    "text,needle",
    [
        (_bomb(), "aliases"),  # 9 levels of 9 aliases: 387 million values once expanded
        ("name: " + "[" * 5000 + "]" * 5000 + "\n", "nest"),
        ("name: " + "[" * 40 + "]" * 40 + "\n", "nested more than"),
        ("a: &a [*a]\nname: x\n", "recursive"),
    ],
    ids=["billion-laughs", "5000-brackets", "40-brackets", "recursive-alias"],
)
def test_costly_yaml_is_refused_at_once_with_one_line(tmp_path, capsys, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    msg, took = _timed_error(path)
    assert needle in msg and len(msg.splitlines()) == 1 and len(msg) < 300
    assert took < 1.0
    code, line = _one_line(capsys, "config", "validate", str(path))
    assert code == 1 and needle in line


def test_huge_files_are_refused_before_reading(tmp_path, capsys):
    path = tmp_path / "big.yaml"
    with open(path, "wb") as f:
        f.write(b"description: '")
        f.seek(16 * 1024 * 1024)
        f.write(b"'\n")
    msg, took = _timed_error(path)
    assert "at most 64 KiB" in msg and took < 1.0
    assert MAX_CONFIG_BYTES == 64 * 1024
    code, line = _one_line(capsys, "config", "validate", str(path))
    assert code == 1 and "16,777,218 bytes" in line


def test_bad_values_are_described_briefly_whatever_their_size(tmp_path):
    path = tmp_path / "long.yaml"
    path.write_text(
        "name: x\nschedule: {layers: [1], removal_ratios: [0.5]}\npartitioner: ["
        + ", ".join(["1"] * 5000)
        + "]\n"
    )
    msg, took = _timed_error(path)
    assert took < 1.0 and len(msg) < 300 and "..." in msg


def test_many_problems_are_counted_not_all_printed():
    err = ConfigError([(f"f{i}", "bad") for i in range(50)])
    assert len(str(err).splitlines()) == ConfigError.MAX_LINES + 1 and "40 more" in str(err)


def test_dash_reads_standard_input(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(VALID.encode())))
    assert load_config("-").name == "mine"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(VALID.encode())))
    assert main(["config", "validate", "-"]) == 0
    assert "valid pipeline 'mine'" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x" * (MAX_CONFIG_BYTES + 10))))
    with pytest.raises(ConfigError, match="<stdin>: more than 64 KiB"):
        load_config("-")


def test_devices_fifos_and_directories_get_their_own_message(tmp_path, capsys):
    code, line = _one_line(capsys, "config", "validate", os.devnull)
    assert code == 1 and "got an empty document" in line
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    start = time.perf_counter()
    code, line = _one_line(capsys, "config", "validate", str(fifo))  # no writer: must not hang
    assert code == 1 and "empty document" in line and time.perf_counter() - start < 5
    code, line = _one_line(capsys, "config", "validate", str(tmp_path))
    assert code == 2 and "is a directory, not a file" in line
    code, line = _one_line(capsys, "config", "validate", str(tmp_path / "none.yaml"))
    assert code == 2 and "does not exist" in line


def test_non_utf8_files_are_named(tmp_path, capsys):
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00name")
    code, line = _one_line(capsys, "config", "validate", str(path))
    assert code == 1 and "not UTF-8" in line and "bin.yaml" in line


def test_presets_still_load_through_the_checks():
    from lightkv.presets import PRESETS

    for preset in PRESETS.values():
        assert PipelineConfig.from_yaml_text(preset.config.to_yaml()) == preset.config


def test_a_slipped_key_suggests_the_field_it_starts():
    from lightkv.config import _did_you_mean

    with pytest.raises(
        ConfigError, match="unknown field 'windowz'; did you mean 'windows_per_side'"
    ):
        PipelineConfig.from_dict(
            {"schedule": {"layers": [1], "removal_ratios": [0.5], "windowz": [2]}}
        )
    assert "'split'" in _did_you_mean("splitt", ["split", "seed"])
    assert "'grid'" in _did_you_mean("gird", ["grid", "global", "pseudo_square"])
    assert "'window_size'" in _did_you_mean("window_sise", ["window_size", "windows_per_side"])


def test_a_decompression_bomb_image_is_one_line(tmp_path, monkeypatch):
    from PIL import Image

    from lightkv import generate as g

    path = tmp_path / "huge.png"
    Image.new("RGB", (40, 40)).save(path)
    monkeypatch.setattr(
        Image, "MAX_IMAGE_PIXELS", 100
    )  # 1,600 pixels is then a "bomb", as 20000 x 20000 is
    with pytest.raises(g.GenerateError, match="too large to decode safely"):
        g.load_image(path)


def test_generate_refuses_an_empty_prompt_and_its_help_is_right(capsys):
    code, line = _one_line(capsys, "generate", "--prompt", "")
    assert code == 2 and "--prompt is empty" in line
    assert main(["generate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps at hyphens
    assert "default: lightkv where its schedule fits the model's depth, else lightkv-budget" in out
    assert "default: scenes" in out
    assert main(["--help"]) == 0
    assert "llava-hf/llava-1.5-7b-hf" in capsys.readouterr().out


def test_stages_demo_checks_out_before_any_output(tmp_path, capsys):
    target = tmp_path / "taken.png"
    target.write_text("x")
    code = main(["stages-demo", "--out", str(target)])
    out, err = capsys.readouterr()
    assert (
        code == 2
        and out == ""
        and f"--out {target}: not a directory" in err
        and "Traceback" not in err
    )


def test_a_missing_extra_is_named_in_one_line(capsys, monkeypatch):
    import lightkv.cli.configs as cli

    def needs_skimage(args):
        raise ModuleNotFoundError("No module named 'skimage'", name="skimage")

    monkeypatch.setattr(cli, "_cmd_presets", needs_skimage)
    code, line = _one_line(capsys, "presets")
    assert code == 2 and line.endswith("which is not installed: pip install scikit-image")
