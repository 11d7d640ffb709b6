"""Benchmarks that ship with lightkv (run by ``lightkv bench ...``).

* `lightkv_lab.bench.efficiency`: prefill FLOPs, KV bytes, time to first token, peak memory
  and compression overhead, uncompressed vs presets, on random-weight models with the
  real vision-token counts of LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision (7,290), Qwen2.5-VL
  (an image, and a 16-frame video) and InternVL.
"""

__all__ = ["efficiency"]
