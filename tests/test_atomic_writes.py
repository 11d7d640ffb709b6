"""Results are written whole or not at all (issue 40 item 2).

A full disk used to leave 0-byte or truncated ``efficiency.json`` / ``scaling.json`` /
``*.png`` files in place of older good ones. Every result now goes through
`lightkv.outputs.write_atomic`: a temporary file in the same folder, renamed into place.
Faults are injected into the writer, and a small tmpfs is filled where one can be mounted.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from lightkv.outputs import write_atomic


def _full_disk(f):
    f.write(b'{"half": ')
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "efficiency.json"
    path.write_text('{"good": 1}\n')
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, _full_disk)
    assert path.read_text() == '{"good": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["efficiency.json"]


def test_a_failed_first_write_leaves_no_file(tmp_path):
    with pytest.raises(OSError):
        write_atomic(tmp_path / "scaling.json", _full_disk)
    assert list(tmp_path.iterdir()) == []


def test_text_bytes_and_writers_land_whole_with_the_usual_mode(tmp_path):
    assert write_atomic(tmp_path / "a.md", "é\n").read_text(encoding="utf-8") == "é\n"
    assert write_atomic(tmp_path / "b.bin", b"\x00\x01").read_bytes() == b"\x00\x01"
    assert write_atomic(tmp_path / "c.txt", lambda f: f.write(b"x")).read_bytes() == b"x"
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a.md").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0o600
    (tmp_path / "a.md").chmod(0o640)
    write_atomic(tmp_path / "a.md", "again")
    assert (tmp_path / "a.md").stat().st_mode & 0o777 == 0o640  # a replaced file keeps its mode


def test_a_figure_that_fails_to_render_keeps_the_old_picture(tmp_path):
    pytest.importorskip("matplotlib")
    from lightkv_lab import vis

    path = tmp_path / "lightkv-demo-provenance.png"
    path.write_bytes(b"old picture")
    fig = vis.pyplot().figure()
    with pytest.raises(ValueError):
        vis.save_figure(fig, tmp_path / "x.nosuchformat")
    assert not (tmp_path / "x.nosuchformat").exists()
    fig = vis.pyplot().figure()
    vis.save_figure(fig, path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_a_report_that_fails_to_render_writes_neither_file(tmp_path, monkeypatch):
    """The JSON and the markdown are both rendered before either is written: a failure in
    the second (as the ablation's ``KeyError`` was) keeps the first as it was."""
    from lightkv_lab.bench.efficiency import report

    (tmp_path / "efficiency.json").write_text('{"good": 1}\n')

    def broken(result):
        raise KeyError("exists")

    monkeypatch.setattr(report, "markdown_table", broken)
    with pytest.raises(KeyError):
        report.write_outputs({"models": {}}, tmp_path, with_plots=False)
    assert (tmp_path / "efficiency.json").read_text() == '{"good": 1}\n'
    assert not (tmp_path / "efficiency.md").exists()


def test_to_yaml_on_a_failing_writer_keeps_the_old_file(tmp_path, monkeypatch):
    import lightkv
    from lightkv.config import pipeline as config_pipeline

    path = tmp_path / "mine.yaml"
    path.write_text("old: yes\n")

    def fails(target, content):
        return write_atomic(target, _full_disk)

    monkeypatch.setattr(config_pipeline, "write_atomic", fails)
    with pytest.raises(OSError):
        lightkv.load_config("lightkv").to_yaml(path)
    assert path.read_text() == "old: yes\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "mine.yaml"
    ]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs (skipped where it cannot be mounted: not root, no mount permission)."""
    where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("mount is not available")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True, timeout=10)


def test_a_full_tmpfs_keeps_the_previous_scaling_results(small_tmpfs):
    from lightkv_lab.bench.efficiency import scaling as sc

    result = {"config": {"sides": [4]}, "stage": {"points": [], "exponents": {}}}
    try:
        first = sc.write_scaling(result, small_tmpfs, with_plots=False)
    except Exception:  # noqa: BLE001  (the markdown needs more of a real result: write the JSON alone)
        first = [write_atomic(small_tmpfs / "scaling.json", json.dumps(result) + "\n")]
    before = {p.name: p.read_bytes() for p in first}
    with pytest.raises(OSError) as info:
        write_atomic(small_tmpfs / "scaling.json", json.dumps({"pad": "x" * 200_000}))
    assert info.value.errno == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in first} == before and all(before.values())
    assert sorted(p.name for p in Path(small_tmpfs).iterdir()) == sorted(before)


def test_a_benchmark_on_a_full_disk_keeps_the_older_results(small_tmpfs, capsys):
    """The issue's case end to end: the output folder passes the up-front check (an empty
    file fits), the run goes to the end, and the write fails: one line, and the older
    ``scaling.json`` / ``scaling.md`` stay as they were, with no empty or temporary file."""
    from lightkv.cli import main

    old = {"scaling.json": b'{"older": "good"}\n' + b" " * 1500, "scaling.md": b"older table\n"}
    for name, data in old.items():
        (small_tmpfs / name).write_bytes(data)
    free = os.statvfs(small_tmpfs)
    (small_tmpfs / "filler").write_bytes(b"x" * max(0, free.f_bavail * free.f_frsize - 512))
    code = main(
        ["bench", "scaling", "--quick", "--no-prefill", "--no-plots", "--out", str(small_tmpfs)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == (
        f"lightkv: error: cannot write {small_tmpfs / 'scaling.json'}: No space left on "
        "device; any previous file there is unchanged"
    ), err
    assert {name: (small_tmpfs / name).read_bytes() for name in old} == old
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["filler", "scaling.json", "scaling.md"]
