"""`benchmarks/instruments.py`: retained shares, competition ranks and moved ranks between two
quality results, against values worked out by hand."""

from __future__ import annotations

import pytest

from tests.scripts import load_script


def _mod():
    return load_script("instruments")


def _result(task, base, rows):
    return {
        "benchmark": f"{task}-quality",
        "model": {"task": task},
        "uncompressed": {"accuracy": {"overall": base}},
        "rows": [
            {"method": m, "target": t, "accuracy": {"overall": acc}} for m, t, acc in rows
        ] + [{"method": "x", "target": 1.0, "accuracy": {"overall": base}}],
    }  # fmt: skip


def test_ranks_and_moves_by_hand():
    m = _mod()
    a = _result("scenes", 0.5, [("p", 0.11, 0.5), ("q", 0.11, 0.4), ("r", 0.11, 0.4),
                                ("s", 0.11, 0.1), ("only-a", 0.11, 0.3)])  # fmt: skip
    b = _result("photos", 0.8, [("p", 0.11, 0.2), ("q", 0.11, 0.8), ("r", 0.11, 0.6),
                                ("s", 0.11, 0.7)])  # fmt: skip
    c = m.compare(a, b, moved=2)
    rows = {r["method"]: r for r in c["rows"]}
    assert set(rows) == {"p", "q", "r", "s"}  # only methods both results hold
    assert rows["p"]["a"] == pytest.approx(100.0) and rows["p"]["b"] == pytest.approx(25.0)
    assert [rows[k]["rank_a"] for k in "pqrs"] == [1, 2, 2, 4]  # q and r tie for 2nd
    assert [rows[k]["rank_b"] for k in "pqrs"] == [4, 1, 3, 2]
    assert [rows[k]["moved"] for k in "pqrs"] == [True, False, False, False]
    assert "| p | 100.0 | 1 | 25.0 | 4 | -3 |" in m.markdown(c)


def test_a_method_at_its_nearest_fraction_is_listed_but_not_ranked():
    m = _mod()
    a = _result("scenes", 0.5, [("p", 0.11, 0.5), ("q", 0.11, 0.4)])
    b = _result("photos", 0.5, [("p", 0.11, 0.1), ("q", 0.11, 0.4)])
    b["rows"][0]["how"] = "nearest"
    rows = {r["method"]: r for r in m.compare(a, b)["rows"]}
    assert rows["p"]["rank_a"] is None and rows["p"]["moved"] is None
    assert rows["q"]["rank_a"] == rows["q"]["rank_b"] == 1
    assert "| p | 100.0 | - | 20.0 | - | (not ranked: nearest fraction or cache) |" in m.markdown(
        m.compare(a, b)
    )


def test_a_result_whose_model_answers_nothing_is_refused():
    with pytest.raises(ValueError, match="answers nothing"):
        _mod().retained(_result("photos", 0.0, []))
