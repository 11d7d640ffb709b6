"""Accuracy vs kept vision KV on DigitGrid-VQA: every method at 100/75/55/40/25% with the
bundled model.

The bundled DigitGrid LVLM (a trained `LlavaForConditionalGeneration`, 256 vision tokens,
6 decoder layers) answers 2,000 held-out questions whose answers live in one image region;
each preset runs with its schedule scaled to the model's depth and one common ratio chosen
for each kept-fraction target. The logic lives in `lightkv_lab.bench.quality`; this script is
the same as ``lightkv bench quality``:

    python benchmarks/quality.py                       # full run (~20 min on 2 CPU cores)
    python benchmarks/quality.py --episodes 200 --methods lightkv fastv --kept-fractions 1 0.55

Writes ``benchmarks/results/quality.json``, ``quality.md``, ``quality.png`` and
``quality-provenance.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightkv.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "quality", *sys.argv[1:]]))
