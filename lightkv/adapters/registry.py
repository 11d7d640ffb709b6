"""Family name -> adapter, and detection from ``model.config.model_type``."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from .base import Adapter

__all__ = ["SUPPORTED_FAMILIES", "adapter_class", "detect_family", "get_adapter"]

SUPPORTED_FAMILIES: dict[str, str] = {
    "llava": "lightkv.adapters.llava:LlavaAdapter",
    "llava_next": "lightkv.adapters.llava_next:LlavaNextAdapter",
    "qwen2_5_vl": "lightkv.adapters.qwen2_5_vl:Qwen25VLAdapter",
    "internvl": "lightkv.adapters.internvl:InternVLAdapter",
    "fuyu": "lightkv.adapters.fuyu:FuyuAdapter",
}
"""Family name -> ``module:class`` of its adapter (imported on first use)."""

MODEL_TYPES: dict[str, str] = {
    "llava": "llava",
    "llava_next": "llava_next",
    "qwen2_5_vl": "qwen2_5_vl",
    "internvl": "internvl",
    "internvl_chat": "internvl",
    "fuyu": "fuyu",
}
"""``config.model_type`` -> family."""


def adapter_class(family: str) -> type[Adapter]:
    """The adapter class of a family.

    Raises:
        ValueError: unknown family (the message lists the supported ones).
    """
    try:
        target = SUPPORTED_FAMILIES[family]
    except KeyError:
        raise ValueError(
            f"unknown model family {family!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        ) from None
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def detect_family(model: nn.Module) -> str:
    """The family of a model, from ``model.config.model_type``.

    Raises:
        ValueError: the model type is not supported (the message lists the families).
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = MODEL_TYPES.get(model_type)
    if family is None:
        raise ValueError(
            f"lightkv has no adapter for {type(model).__name__} (model_type={model_type!r}); supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)} (model types: {', '.join(MODEL_TYPES)})"
        )
    return family


def get_adapter(model: nn.Module, family: str | None = None, **options: Any) -> Adapter:
    """An adapter for ``model`` (family detected unless given)."""
    return adapter_class(family or detect_family(model))(model, **options)
