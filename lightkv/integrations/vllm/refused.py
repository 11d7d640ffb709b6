"""LLaVA and LLaVA-NeXT under lightkv's architecture names: registered only to refuse.

A user who asks vLLM for ``LightKVLlavaForConditionalGeneration`` or
``LightKVLlavaNextForConditionalGeneration`` gets this module's message when the engine
builds the model's processor (or the model), instead of vLLM's "architecture not supported"
or, worse, a stock run. What building them would take: LLaVA-1.5 is a fixed 24x24 grid (the
kept count follows from the pipeline at once); LLaVA-NeXT's anyres sequence has a base grid,
high-resolution tiles and row-newline tokens, so the placeholder count and the survivors'
layout must follow lightkv's ``llava_next`` adapter. Neither is done yet.
"""

from __future__ import annotations

from typing import Any, NoReturn

from . import check_version

check_version()

from vllm.model_executor.models.llava import LlavaForConditionalGeneration
from vllm.model_executor.models.llava_next import LlavaNextForConditionalGeneration
from vllm.multimodal import MULTIMODAL_REGISTRY

__all__ = [
    "LightKVLlavaForConditionalGeneration",
    "LightKVLlavaNextForConditionalGeneration",
    "refuse",
]


def refuse(family: str) -> NoReturn:
    """Raise the plugin's refusal for ``family``.

    Raises:
        NotImplementedError: always; the message names what is supported.
    """
    raise NotImplementedError(
        f"lightkv's vLLM plugin does not compress {family} yet: only Qwen2.5-VL "
        "(LightKVQwen2_5_VLForConditionalGeneration) is supported. "
        "Serve this model without the LightKV "
        "architecture in hf_overrides, or compress it with lightkv.apply in transformers"
    )


def _refuse_llava(*_: Any, **__: Any) -> NoReturn:
    refuse("LLaVA-1.5")


def _refuse_llava_next(*_: Any, **__: Any) -> NoReturn:
    refuse("LLaVA-NeXT")


@MULTIMODAL_REGISTRY.register_processor(
    _refuse_llava, info=_refuse_llava, dummy_inputs=_refuse_llava
)
class LightKVLlavaForConditionalGeneration(LlavaForConditionalGeneration):
    """Refuses LLaVA-1.5 (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse("LLaVA-1.5")


@MULTIMODAL_REGISTRY.register_processor(
    _refuse_llava_next, info=_refuse_llava_next, dummy_inputs=_refuse_llava_next
)
class LightKVLlavaNextForConditionalGeneration(LlavaNextForConditionalGeneration):
    """Refuses LLaVA-NeXT (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse("LLaVA-NeXT")
