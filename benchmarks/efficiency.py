"""Prefill efficiency, uncompressed vs each preset: analytic FLOPs, KV bytes, time to first
token, peak memory and compression overhead, on LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision,
Qwen2.5-VL (image and video) and InternVL shapes.

Random-weight models with the real vision-token counts (576, 2,928, 7,290 + 81, 1,024,
4,096 for 16 frames, 5 x 256) and the real head dimension, MLP and grouped-query ratios,
with reduced decoders (8 layers, width 512 / 896; schedules scaled to that depth). The logic
lives in `lightkv_lab.bench.efficiency`; this script is the same as ``lightkv bench
efficiency``:

    # full run (~14 min on 2 idle CPU cores: six shapes, six presets)
    python benchmarks/efficiency.py
    python benchmarks/efficiency.py --quick      # < 2 min, to benchmarks/results/quick/
    python benchmarks/efficiency.py --models llava_next --presets lightkv fastv --repeats 7

Writes ``benchmarks/results/efficiency.json``, ``efficiency.md``, ``efficiency-ratios.png``
and (up to 24 bars) ``efficiency-overhead.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightkv.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "efficiency", *sys.argv[1:]]))
