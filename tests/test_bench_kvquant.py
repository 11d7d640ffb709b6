"""The KV-quantization benchmark on a tiny shape: bytes, not timings. fp8 needs no extra
package, so this runs everywhere; quanto's rows are checked where it is installed (and
required under ``--require-quant``, as `make test-quant` runs them in CI)."""

from __future__ import annotations

import pytest
from lightkv_lab.bench.efficiency import kvquant as kq

from lightkv.cli import main


@pytest.fixture(scope="module")
def result():
    return kq.run_kvquant(kq.KVQuantConfig(models=("llava",), backends=("fp8",), layers=6, heads=1))


def test_bytes_compose(result):
    m = result["models"]["llava"]
    b, r = m["kv_bytes"], m["ratio"]
    assert r["dynamic"] == 1.0
    # float32 -> 8-bit entries: a quarter of the bytes, plus the per-tensor scales
    assert 0.25 < r["fp8"] < 0.2501
    # lightkv removes the same entries from either cache: the two savings multiply
    assert r["fp8+lightkv"] == pytest.approx(r["fp8"] * r["dynamic+lightkv"], rel=1e-3)
    assert b["fp8+lightkv"] < b["fp8"] < b["dynamic+lightkv"] < b["dynamic"]
    md = kq.kvquant_markdown(result)
    assert "| llava | 1.000 |" in md and "`fp8+lightkv`" in md


def test_config_errors(capsys, tmp_path):
    with pytest.raises(ValueError, match="unknown backend"):
        kq.KVQuantConfig(backends=("int3",))
    assert main(["bench", "kvquant", "--models", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err
    if "quanto-4" not in kq.available_backends():
        with pytest.raises(ValueError, match=r"lightkv\[quant\]"):
            kq.KVQuantConfig(backends=("quanto-4",))


def test_quanto_rows_compose_with_lightkv(quanto):
    res = kq.run_kvquant(
        kq.KVQuantConfig(models=("llava",), backends=("quanto-4",), layers=6, heads=1)
    )
    r = res["models"]["llava"]["ratio"]
    assert r["quanto-4"] < 0.5  # 4-bit entries plus scales and the full-precision residual
    assert r["quanto-4+lightkv"] < r["quanto-4"] < r["dynamic"]
