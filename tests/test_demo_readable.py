"""`lightkv demo` reads well (issue 40 item 9): long questions wrap inside their column, the
picture's titles stay inside the picture, and the method comparison says where it is."""

from __future__ import annotations

import pytest
from lightkv_lab.demos import bundled


def test_a_long_question_wraps_inside_its_column(capsys):
    assert bundled.main(["--questions", "12", "--contrast", "0", "--no-png"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("question"))
    truth_at = lines[head].index("truth")
    rows = lines[head + 2 : lines.index("", head)]
    assert any(
        not r.startswith("'") for r in rows
    )  # a question long enough to wrap (Scenes' two-object one)
    for r in rows:
        if r.startswith("'"):  # a row: the question's first line ends before the truth column
            assert r[truth_at - 1] == " " and r[truth_at] != " ", r
        else:  # a continuation: the rest of the question, nothing in the other columns
            assert r.startswith(" ") and len(r.rstrip()) < truth_at, r
    assert bundled._question_lines("where is the red object the yellow object".split()) == [
        "'where is the red object the",
        " yellow object'",
    ]


def test_the_comparison_reads_one_way_round_with_intervals_and_lightkv_cover(capsys):
    """Issue 52 item 5: every method of the comparison, lightkv-cover beside the leaders,
    with lightkv minus the method and a paired bootstrap interval; both slashed columns
    compressed/uncompressed; off a terminal no progress output (item 6: a bar only there)."""
    assert bundled.main(["--questions", "1", "--contrast", "4", "--no-png"]) == 0
    out, err = capsys.readouterr()
    assert "lightkv demo: [" not in err and "it/s" not in err
    lines = out.splitlines()
    assert sum("comp/uncomp" in line for line in lines) == 1
    assert lines[next(i for i, x in enumerate(lines) if "comp/uncomp" in x) + 1].startswith(
        "question"
    )
    assert "vision KV and prefill both compressed/uncompressed" in out
    assert bundled.METHODS[:2] == ("lightkv", "lightkv-cover")
    for target in ("55%", "25%"):
        at = next(i for i, line in enumerate(lines) if line.startswith(f"at {target} of"))
        assert "lightkv minus the method in points, paired bootstrap 95% interval" in lines[at]
        rows = lines[at + 1 : at + 1 + len(bundled.METHODS)]
        assert [r.split()[0] for r in rows] == list(bundled.METHODS)
        assert "[" not in rows[0]  # the comparator itself
        for row in rows[1:]:
            low, high = row[row.index("[") + 1 : row.index("]")].split(", ")
            assert float(low) <= float(row.split(")")[-1].split("[")[0]) <= float(high), row


def test_picture_titles_stay_inside_the_picture(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from lightkv_lab import vis
    from lightkv_lab.bench import provenance, quality_report

    figures = []
    real = vis.save_figure

    def keep(fig, path, **kw):
        fig.tight_layout()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        figures.append(
            [(ax.title.get_text(), ax.title.get_window_extent(renderer), box) for ax in fig.axes]
        )
        return real(fig, path, **kw)

    monkeypatch.setattr(vis, "save_figure", keep)
    quality_report.provenance_picture(tmp_path / "p.png", "scenes")
    titles = figures[0]
    assert len(titles) == 4
    for text, extent, box in titles:
        assert box.x0 - 0.5 <= extent.x0 and extent.x1 <= box.x1 + 0.5, (text, extent, box)
        assert extent.y1 <= box.y1 + 0.5, (text, extent, box)
        assert all(len(line) <= provenance.TITLE_CHARS for line in text.splitlines()), text
