"""The scaling benchmark on tiny sizes: the exponent fit against exact power laws, the
structure of a run and its files, and the CLI. Timings are not asserted."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lightkv_lab.bench.efficiency import scaling as sc

from lightkv.cli import main


@given(
    k=st.floats(-2, 3),
    c=st.floats(1e-3, 1e3),
    ns=st.lists(st.integers(2, 10**5), min_size=2, max_size=6, unique=True),
)
def test_fit_exponent_recovers_a_power_law(k, c, ns):
    assert sc.fit_exponent(ns, [c * n**k for n in ns]) == pytest.approx(k, abs=1e-6)


def test_fit_exponent_of_a_constant_plus_linear_term_lies_between():
    ns = [576, 1024, 2916, 7225]
    k = sc.fit_exponent(ns, [100 + n for n in ns])
    assert 0 < k < 1


@pytest.fixture(scope="module")
def stage_only():
    return sc.run_scaling(sc.quick_scaling(prefill=False))


def test_stage_only_run(stage_only, tmp_path):
    pts = stage_only["stage"]["points"]
    assert [p["vision_tokens"] for p in pts] == [s * s for s in stage_only["config"]["sides"]]
    names = list(stage_only["stage"]["exponents"])
    assert len(names) == 2 and all(p[n] > 0 for p in pts for n in names)
    assert all(math.isfinite(v) for v in stage_only["stage"]["exponents"].values())
    assert "prefill" not in stage_only
    md = sc.scaling_markdown(stage_only)
    assert "fitted exponent" in md and f"| {pts[-1]['vision_tokens']:,} |" in md
    files = sc.write_scaling(stage_only, tmp_path, with_plots=False)
    assert {f.name for f in files} == {"scaling.json", "scaling.md"}
    assert json.loads((tmp_path / "scaling.json").read_text())["stage"]["points"] == pts


def test_prefill_points_split_the_compressed_prefill():
    res = sc.prefill_scaling(sc.quick_scaling(sides=(8, 12)))
    for p in res["points"]:
        assert p["vision_tokens"] < p["prompt_tokens"]
        parts = sum(p[f"{k}_ms"] for k in ("layout", "relevance", "stage", "bookkeeping"))
        assert 0 < parts < p["lightkv_ms"] and p["overhead_share"] == pytest.approx(
            parts / p["lightkv_ms"]
        )
    assert set(res["exponents"]) == {"uncompressed_ms", "lightkv_ms", "stage_ms", "relevance_ms"}


def test_config_errors_and_cli(tmp_path, capsys):
    with pytest.raises(ValueError, match="two image sides"):
        sc.ScalingConfig(sides=(24,))
    assert main(["bench", "scaling", "--sides", "8", "--quick"]) == 2
    assert "two image sides" in capsys.readouterr().err
    assert (
        main(["bench", "scaling", "--quick", "--no-prefill", "--no-plots", "--out", str(tmp_path)])
        == 0
    )
    assert (tmp_path / "scaling.md").exists()
