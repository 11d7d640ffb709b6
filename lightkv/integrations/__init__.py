"""lightkv inside other tools' evaluation loops.

- `lightkv.integrations.lmms_eval`: the ``lightkv`` model of lmms-eval (``--model lightkv``),
  registered through lmms-eval's ``lmms_eval.models`` entry-point group; it needs the
  ``lmms-eval`` extra (``make lmms-eval``).
- `lightkv.integrations.session_log`: what that model logs per sample and in aggregate
  (per-row session reports, prefill timing, data-parallel placement); torch only.
- `lightkv.integrations.vllm`: the vLLM plugin (``vllm.general_plugins``): lightkv's
  pre-LLM, prompt-agnostic pipelines inside vLLM's Qwen2.5-VL; its ``plan`` module needs no
  vLLM, the model modules need vLLM 0.32.x or 0.33.x (``SUPPORTED_VLLM``; ``make vllm`` on a
  CPU).

Nothing else in lightkv imports this package, and ``import lightkv`` never needs lmms-eval
or vLLM.
"""
