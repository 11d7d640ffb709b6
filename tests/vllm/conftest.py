"""Fixtures of the vLLM plugin's tests (`make test-vllm`; outside the main suite).

The tiny model is built once per session (offline); every engine runs in a subprocess of its
own (`engine.py`: one process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor),
and its result is cached per settings, so tests that read the same engine share one start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: run `make test-vllm`")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import tiny

QWEN = "LightKVQwen2_5_VLForConditionalGeneration"
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny random Qwen2.5-VL, saved to disk."""
    return tiny.build(tmp_path_factory.mktemp("tiny-qwen2_5_vl"))


@pytest.fixture(scope="session")
def engine(model_dir, tmp_path_factory):
    """``engine(**request)`` -> the JSON result of `engine.py` (cached per request)."""
    cache: dict[str, dict] = {}
    work = tmp_path_factory.mktemp("engines")

    def run(**req) -> dict:
        req = {"model": str(model_dir), **req}
        key = json.dumps(req, sort_keys=True)
        if key not in cache:
            n = len(cache)
            src, dst = work / f"req{n}.json", work / f"res{n}.json"
            src.write_text(key)
            proc = subprocess.run(
                [sys.executable, str(HERE / "engine.py"), str(src), str(dst)],
                env={**os.environ, **ENV},
                capture_output=True,
                text=True,
                timeout=900,
            )
            if not dst.exists():
                raise AssertionError(
                    f"engine.py died (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
                )
            cache[key] = json.loads(dst.read_text())
        return cache[key]

    return run
