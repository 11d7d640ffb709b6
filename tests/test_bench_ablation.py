"""`lightkv bench ablation`: variants are the lightkv preset with exactly the named parts
swapped, every method sees the same conversations, and the outputs come from the rows."""

from __future__ import annotations

import json

import pytest
from lightkv_lab.bench import ablation as ab
from lightkv_lab.bench.budgets import knob_pipeline


@pytest.fixture(scope="module")
def result():
    return ab.run(
        ab.AblationConfig(
            models=("digitgrid",),
            episodes=12,
            targets=(0.55,),
            variants=("size-aware messages", "relevance split"),
            baselines=("lightkv", "tome"),
            batch=12,
            bootstrap=200,
        ),
        progress=False,
    )


@pytest.mark.parametrize("name", list(ab.VARIANTS))
def test_a_variant_swaps_only_its_parts(name):
    ref, how = knob_pipeline("lightkv", 8, 0.55)
    var, vhow = ab.variant_pipeline(name, 8, 0.55)
    assert vhow == how and var.scheduler == ref.scheduler  # same budget, same stages
    for family in (
        "partitioner",
        "scorer",
        "pruner",
        "passer",
        "relevance",
        "proportional_attention",
    ):
        swapped = family in ab.VARIANTS[name]
        assert (getattr(var, family) != getattr(ref, family)) == swapped, family
        if swapped and family != "proportional_attention":
            assert getattr(var, family).name == ab.VARIANTS[name][family][0]


def test_unknown_variant_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown variant 'nope'"):
        ab.variant_pipeline("nope", 8, 0.55)


def test_rows_cover_every_method_on_the_same_conversations(result):
    (m,) = result["models"]
    methods = [r["method"] for r in m["rows"]]
    assert methods == [
        "lightkv",
        "tome",
        "lightkv (size-aware messages)",
        "lightkv (relevance split)",
    ]
    assert {r["target"] for r in m["rows"]} == {0.55}
    light = m["rows"][0]
    assert "vs_baseline" not in light  # lightkv is the reference of the intervals
    for r in m["rows"][1:]:
        mean, lo, hi = r["vs_baseline"]["accuracy"]["overall"]
        assert lo <= mean <= hi
        assert abs(mean - (light["accuracy"]["overall"] - r["accuracy"]["overall"])) < 1e-9
    assert all(0.5 <= r["kept_fraction"] <= 0.62 for r in m["rows"])


def test_outputs(result, tmp_path):
    paths = ab.write_outputs(result, tmp_path)
    assert [p.name for p in paths] == ["ablation.json", "ablation.md", "ablation.png"]
    assert json.loads(paths[0].read_text())["models"][0]["rows"] == json.loads(
        json.dumps(result["models"][0]["rows"])
    )
    md = paths[1].read_text()
    assert "| lightkv (relevance split) |" in md and "At 55% kept" in md
    assert paths[2].stat().st_size > 0


def test_cli_refuses_bad_arguments(capsys):
    from lightkv.cli import main

    assert main(["bench", "ablation", "--variants", "nope"]) == 2
    assert "unknown variant 'nope'" in capsys.readouterr().err
    assert main(["bench", "ablation", "--targets", "1.0"]) == 2
