"""The bundled demo (`lightkv stages-demo`, `python -m lightkv_lab.stages_demo`) runs offline and
reports the paper's counts."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("skimage")

from lightkv_lab import stages_demo as demo


def _stage_counts(out: str, preset: str) -> list[int]:
    """Vision-kept column of the stage rows printed for ``preset``."""
    block = out.split(f"preset {preset!r}:", 1)[1].split("preset '", 1)[0]
    rows = re.findall(
        r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+-\d+\s+[\d.]+$", block, flags=re.MULTILINE
    )
    return [int(r[3]) for r in rows]


def _kept_fraction(out: str, preset: str) -> float:
    block = out.split(f"preset {preset!r}:", 1)[1]
    return float(re.search(r"averaged over 32 layers: ([\d.]+) from the counts", block).group(1))


def test_demo_prints_paper_counts_and_writes_png(tmp_path, capsys):
    assert demo.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out

    assert _stage_counts(out, "lightkv") == [288, 144, 72]
    assert _stage_counts(out, "lightkv-paper") == [288, 145, 73]
    # 13 layers x 576 + 6 x 288 + 6 x 144 + 7 x 72 (resp. 145, 73) over 32 x 576.
    assert _kept_fraction(out, "lightkv") == pytest.approx(10584 / 18432, abs=1e-4)
    assert _kept_fraction(out, "lightkv-paper") == pytest.approx(10597 / 18432, abs=1e-4)
    assert "red/orange" in out

    # The ASCII provenance map: 24 rows of 24 relevance shades and 24 doubled symbols, with
    # exactly as many distinct symbols as survivors of the last stage.
    block = out.split("preset 'lightkv':", 1)[1].split("preset '", 1)[0]
    rows = re.findall(r"^  \|(.{24})\|   \|(.{48})\|$", block, flags=re.MULTILINE)
    assert len(rows) == 24
    symbols = {cell for _, prov in rows for cell in prov[::2]}
    assert len(symbols) == 72

    png = tmp_path / "lightkv-demo.png"
    assert png.is_file()
    from skimage import io

    img = io.imread(png)
    # original + 2 panels per preset, 504 px each, with 12 px gaps between presets
    assert img.shape == (504, 504 * 5 + 2 * 12, 3)
    assert img.dtype.name == "uint8" and img.std() > 10


def test_demo_single_preset_without_png(tmp_path, capsys):
    assert demo.main(["--preset", "lightkv", "--no-png", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert _stage_counts(out, "lightkv") == [288, 144, 72]
    assert "lightkv-paper" not in out
    assert not (tmp_path / "lightkv-demo.png").exists()


def test_demo_provenance_covers_every_patch():
    inputs = demo.build_inputs()
    report = demo.run_preset("lightkv", inputs)
    # merging presets drop nothing: every patch belongs to exactly one surviving group
    assert (report.owner >= 0).all()
    assert int(report.group_size.min()) >= 1
    final = report.results[-1]
    vision_sizes = final.sizes[0][final.layout.vision_mask[0]]
    assert int(vision_sizes.sum()) == 576
    # merging is a convex combination, so the colour a survivor carries (hidden channels
    # 0..2) lies inside the colour range of the patches it stands for
    carried = final.hidden[0, :, :3] * inputs.colour_std + inputs.colour_mean
    for token in report.owner.unique().tolist():
        members = inputs.patch_rgb[report.owner == token]
        assert (carried[token] >= members.min(dim=0).values - 1e-4).all()
        assert (carried[token] <= members.max(dim=0).values + 1e-4).all()
    group_mean, token_colour = demo.merged_views(report, inputs)
    assert group_mean.shape == token_colour.shape == (504, 504, 3)


def test_demo_rejects_unknown_preset():
    with pytest.raises(SystemExit):
        demo.main(["--preset", "no-such-preset", "--no-png"])


def test_lightkv_stages_demo_command_forwards_to_the_demo(capsys):
    from lightkv.cli import main as cli_main

    assert cli_main(["stages-demo", "--no-png", "--preset", "lightkv"]) == 0
    out = capsys.readouterr().out
    assert "preset 'lightkv'" in out and "288" in out and "72" in out
