"""Prefill efficiency side by side: uncompressed vs each preset, per model shape.

For model shapes of LLaVA-1.5-7B (576 vision tokens), LLaVA-NeXT-7B (2,928), Qwen2.5-VL-7B
(1,024) and InternVL3-8B (tiles of 256), random-weight models with the *real* vision-token
counts and the real head dimension (128), MLP ratio and grouped-query ratio are run with a
*reduced* decoder (default 8 layers, 4 or 7 heads: width 512 or 896; see `MODELS`), or
with ``width="full"`` (``--width full``) the real width, heads and MLP (7B: 4096, 32 heads,
11008) with only the depth reduced, and for each variant (no compression, then every
preset; with ``projection_baseline`` also LightKV projecting each scheduled layer's input
a second time) this measures:

* **FLOPs**: analytic prefill FLOPs of the language model (`session.report()`: per layer
  projections + attention + MLP at the layer's real length, plus the relevance
  projections), their ratio, and the same ratio for the full-size reference decoder with
  the preset's unscaled schedule (token counts per stage taken from the run);
* **KV bytes**: total and vision KV bytes read from the cache tensors the prefill returns;
* **TTFT**: a prefill that fills the cache and returns the first token, median of
  ``repeats`` runs after ``warmup`` runs, variants interleaved (CUDA events on a GPU);
* **peak memory** of the prefill above the loaded model (CPU: the kernel's resident-set
  high-water mark ``VmHWM``, reset through ``/proc/self/clear_refs`` before each prefill,
  in a child process whose glibc returns every allocation of 256 KiB or more to the system
  on free (``MALLOC_MMAP_THRESHOLD_``), so the high-water mark follows the live tensors;
  CUDA: ``max_memory_allocated``);
* **overhead** of the compression inside the prefill (timing hooks around the session's
  own hooks: layout, relevance, stage = graph + merge + new masks, per-layer bookkeeping)
  as a share of the prefill;
* **reference-style scoring**: at each merge layer, the full ``[B, H, N, N]`` attention
  matrix from the layer's own queries and keys, softmax over the query axis, reduced to
  per-vision-token relevance as the authors' code does (which runs eager attention at
  merge layers), timed and measured for memory next to our relevance.

```python
from lightkv_lab.bench.efficiency import BenchConfig, run
result = run(BenchConfig(models=("llava",), presets=("lightkv",), quick=True))

The package, by responsibility:

* `lightkv_lab.bench.efficiency.specs`: the benchmarked model shapes (`MODELS`, `ModelSpec`);
* `lightkv_lab.bench.efficiency.shapes`: `BenchConfig`, schedules scaled to the reduced depth
  and the reduced models themselves;
* `lightkv_lab.bench.efficiency.measure`: timers, the overhead probe, reference-style scoring,
  peak memory (in a child process on CPU);
* `lightkv_lab.bench.efficiency.accounting`: KV bytes and FLOPs accounting;
* `lightkv_lab.bench.efficiency.model_bench`: one model's measurements (`bench_model`);
* `lightkv_lab.bench.efficiency.runner`: the whole run (`run`);
* `lightkv_lab.bench.efficiency.report`: summary rows, target checks, Markdown and files;
* `lightkv_lab.bench.efficiency.budget_report`: LightKV at kept-fraction budgets: its
  targets and table;
* `lightkv_lab.bench.efficiency.plots`: the bar charts;
* `lightkv_lab.bench.efficiency.profile`: torch.profiler ranges per hook family and the operators
  inside them (``benchmarks/profile_overhead.py``);
* `lightkv_lab.bench.efficiency.scaling`: stage and prefill cost vs vision tokens, with fitted
  exponents (``lightkv bench scaling``).
"""

from __future__ import annotations

from lightkv_lab.bench.efficiency.report import markdown_table, write_outputs
from lightkv_lab.bench.efficiency.runner import run
from lightkv_lab.bench.efficiency.shapes import (
    MODELS,
    PROJECTED,
    RESULTS,
    BenchConfig,
    quick_config,
)
from lightkv_lab.bench.efficiency.specs import HEAD_DIM

__all__ = [
    "HEAD_DIM",
    "MODELS",
    "PROJECTED",
    "RESULTS",
    "BenchConfig",
    "markdown_table",
    "quick_config",
    "run",
    "write_outputs",
]
