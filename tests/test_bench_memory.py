"""The prefill-memory benchmark (`lightkv bench memory`) on tiny sizes: its configuration's
errors, one point measured in this process, one run of child processes, the targets on
made-up results, its files and the CLI. Timings and peaks are not asserted beyond their
signs and order."""

from __future__ import annotations

import json

import pytest
from lightkv_lab.bench.efficiency import memory as mem
from lightkv_lab.bench.efficiency import memory_report as rep

from lightkv.cli import main

TINY = {"layers": 2, "heads": 2, "width": 16, "threads": 1, "width7b": False, "progress": False}


def test_config_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="at least 661 tokens"):
        mem.MemoryConfig(lengths=(600,))
    with pytest.raises(ValueError, match="unknown preset"):
        mem.MemoryConfig(presets=("nope",))
    with pytest.raises(ValueError, match="divisible by the heads"):
        mem.MemoryConfig(heads=3, width=64)
    cfg = mem.MemoryConfig(lengths=(2048, 1024))
    assert cfg.lengths == (1024, 2048)  # ascending
    from lightkv.presets import PRESETS

    assert set(cfg.presets) == set(PRESETS) and cfg.variants[0] == mem.UNCOMPRESSED
    assert mem.MemoryConfig().decoder() == {
        "layers": 8,
        "hidden": 64,
        "heads": 4,
        "head_dim": 16,
        "intermediate": 176,
    }


def test_one_point_in_this_process():
    cfg = mem.MemoryConfig(lengths=(700,), presets=("fastv",), **TINY)
    unc = mem.measure_point(cfg, mem.UNCOMPRESSED, 700)
    fastv = mem.measure_point(cfg, "fastv", 700)
    for p in (unc, fastv):
        assert p["length"] == 700
        assert p["peak_bytes"] >= p["base_bytes"] > 0
        assert p["prefill_bytes"] == p["peak_bytes"] - p["base_bytes"]
        assert p["seconds"] > 0 and p["cpu_seconds"] > 0
    assert unc["kept_vision_fraction"] == 1.0
    assert 0 < fastv["kept_vision_fraction"] < 1


def test_a_run_of_child_processes_and_its_files(tmp_path):
    cfg = mem.MemoryConfig(lengths=(700,), presets=("fastv", "lightkv-budget"), **TINY)
    result = mem.run_memory(cfg)
    pts = {p["variant"]: p for p in result["points"]}
    assert set(pts) == {mem.UNCOMPRESSED, "fastv", "lightkv-budget"}
    for p in pts.values():  # a point that failed says why (a tiny depth may refuse a schedule)
        assert "error" in p or p["peak_bytes"] >= p["base_bytes"] > 0
    assert "error" not in pts[mem.UNCOMPRESSED]
    assert result["targets"]["memory"]["length"] == 700
    files = rep.write_memory(result, tmp_path, with_plot=False)
    assert {f.name for f in files} == {"prefill-memory.json", "prefill-memory.md"}
    assert json.loads((tmp_path / "prefill-memory.json").read_text())["points"] == result["points"]
    assert "| uncompressed |" in (tmp_path / "prefill-memory.md").read_text()


def _made_up(peaks: dict[str, float], cpu: dict[str, float], lengths=(5600, 9600)):
    points = []
    for n in lengths:
        for v in peaks:
            rec = {"variant": v, "length": n}
            if peaks[v] is None:
                rec["error"] = "refused"
            else:
                rec.update(peak_bytes=peaks[v], base_bytes=1e8, cpu_seconds=cpu[v])
            points.append(rec)
    presets = [v for v in peaks if v != mem.UNCOMPRESSED]
    return {
        "config": {"lengths": list(lengths), "presets": presets, "text_before": 20, "repeats": 1},
        "decoder": {"layers": 8, "hidden": 64, "heads": 4, "head_dim": 16, "intermediate": 176},
        "machine": {"threads": 1},
        "points": points,
        "width7b": None,
    }


def test_targets_name_the_presets_that_miss_them_and_the_points_that_failed():
    result = _made_up(
        {mem.UNCOMPRESSED: 0.45e9, "a": 0.70e9, "b": 0.74e9, "c": None},
        {mem.UNCOMPRESSED: 2.0, "a": 1.9, "b": 2.2, "c": 0.0},
    )
    t = rep.check_targets(result)
    assert t["memory"]["length"] == 9600 and t["time"]["length"] == 5600
    assert set(t["memory"]["over"]) == {"b"}  # a is 0.25 GB over: within the limit
    assert t["memory"]["over"]["b"] == pytest.approx(0.29e9)
    assert t["time"]["over"] == {"b": pytest.approx(1.1)}
    assert set(t["memory"]["errors"]) == {"c"} and not t["memory"]["passed"]
    result["targets"] = t
    md = rep.memory_markdown(result)
    assert "b (+0.29 GB)" in md and "b (1.10x)" in md and "c at 9,600: refused" in md
    assert "| a | 0.70 (+0.25) | 0.70 (+0.25) |" in md


def test_cli_refuses_a_short_prompt_in_one_line(capsys):
    assert main(["bench", "memory", "--lengths", "100", "--no-plots", "--out", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "at least 661 tokens" in err[0]
