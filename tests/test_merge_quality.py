"""`benchmarks/merge_quality.py`: a quality run split by ``--methods`` over processes and joined
equals the same run in one process, row for row; parts of different runs are refused."""

from __future__ import annotations

import json

import pytest
from lightkv_lab.bench.quality import AccuracyConfig, run

from tests.scripts import load_script


def _merge_module():
    return load_script("merge_quality")


def _run(methods, seed=0):
    cfg = AccuracyConfig(
        model="digitgrid", episodes=6, methods=methods, targets=(1.0, 0.55), ablations=False,
        relevance_episodes=0, batch=3, bootstrap=50, seed=seed, baseline="lightkv",
    )  # fmt: skip
    return json.loads(json.dumps(run(cfg, progress=False)))


def test_a_split_run_joins_into_the_whole_run():
    merge = _merge_module().merge
    whole = _run(("lightkv", "tome", "fastv"))
    joined = merge([_run(("lightkv", "tome")), _run(("lightkv", "fastv"))])
    assert joined["rows"] == whole["rows"]
    assert joined["uncompressed"] == whole["uncompressed"]
    assert joined["config"]["methods"] == ["lightkv", "tome", "fastv"]


def test_parts_of_different_runs_are_refused():
    merge = _merge_module().merge
    with pytest.raises(ValueError, match="uncompressed|seed"):
        merge([_run(("lightkv",)), _run(("lightkv",), seed=1)])


def test_replace_puts_a_rerun_methods_rows_in_their_old_places():
    merge = _merge_module().merge
    whole = _run(("lightkv", "tome", "fastv"))
    rerun = _run(("lightkv", "tome"))
    for r in rerun["rows"]:
        if r["method"] == "tome":
            r["marker"] = True  # stands for rows a fixed method scores differently
    joined = merge([whole, rerun], replace=True)
    assert [(r["method"], r["target"]) for r in joined["rows"]] == [
        (r["method"], r["target"]) for r in whole["rows"]
    ]
    assert all(bool(r.get("marker")) == (r["method"] == "tome") for r in joined["rows"])
    kept = merge([whole, rerun])  # without replace the first part's rows stay
    assert not any(r.get("marker") for r in kept["rows"])
