"""The vLLM guide's example starts an engine as users start it, and runs.

The Python block of ``docs/guides/vllm.md`` that builds ``LLM(..., hf_overrides=...)`` runs
as it is on the page, in a fresh interpreter with vLLM's defaults (no ``enforce_eager``, the
warm-up with dummy images, default compilation, the engine core in its own process), with
one change: the tiny random Qwen2.5-VL in place of the 7B checkpoint (no Hub access here).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lightkv.integrations.vllm.plan import PreLLMPlan

from .conftest import tiny

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "vllm.md"
CHECKPOINT = "Qwen/Qwen2.5-VL-7B-Instruct"


def guide_example() -> str:
    """The guide's ``LLM(...)`` example: its one Python block with ``hf_overrides`` and
    ``generate``."""
    found = [
        b
        for b in re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.S)
        if "hf_overrides" in b and "llm.generate" in b
    ]
    assert len(found) == 1, f"expected one LLM example in {GUIDE}, found {len(found)}"
    return found[0]


def test_the_guide_states_the_cpu_memory_setting():
    code = guide_example()
    assert "VLLM_CPU_KVCACHE_SPACE" in code and "enforce_eager" not in code
    assert code.count(CHECKPOINT) == 1


def test_the_guides_example_starts_with_default_settings_and_runs(tmp_path):
    model_dir = tiny.build(
        tmp_path / "tiny-qwen2_5_vl", max_positions=32768
    )  # the guide's max_model_len fits
    code = guide_example().replace(CHECKPOINT, str(model_dir))
    script = tmp_path / "guide_example.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}  # as a user's shell
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # this machine's budget; the example's setdefault keeps it
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    printed = re.search(
        r"^(\d+) ", proc.stdout, flags=re.M
    )  # the example's print; vLLM logs to stdout too
    assert printed, proc.stdout[-3000:]
    # the tiny model's 4-pixel patches: a 448 x 448 image is 56 x 56 tokens after the 2 x 2 merge
    # (3,136); divprune keeps 22% of them, and the prompt's text is a dozen tokens.
    kept = PreLLMPlan.load("divprune", num_layers=2).kept_count(56, 56)
    prompt_len = int(printed.group(1))
    assert kept < 0.25 * 56 * 56 and 0 < prompt_len - kept < 40, proc.stdout[-2000:]
