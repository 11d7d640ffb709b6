"""Family name -> adapter, and detection from ``model.config.model_type``.

Besides the shipped families, packages can add adapters through the ``lightkv.adapters``
entry-point group (``vipllava = "my_package.adapter:VipLlavaAdapter"``, the entry-point
name equal to the adapter's ``family``); they are loaded, each on its own, the first time a
family or a model type is not found among the shipped ones.
"""

from __future__ import annotations

import importlib
import warnings
from importlib import metadata
from typing import Any

from torch import nn

from .base import Adapter

__all__ = [
    "ENTRY_POINT_GROUP",
    "SUPPORTED_FAMILIES",
    "adapter_class",
    "detect_family",
    "get_adapter",
    "plugin_adapters",
]

ENTRY_POINT_GROUP = "lightkv.adapters"
_PLUGINS: dict[tuple[str, str], type[Adapter] | str] = {}
"""(entry-point name, target) -> adapter class, or why it failed to load; each entry point
is loaded at most once per process."""

SUPPORTED_FAMILIES: dict[str, str] = {
    "llava": "lightkv.adapters.llava:LlavaAdapter",
    "llava_next": "lightkv.adapters.llava_next:LlavaNextAdapter",
    "qwen2_5_vl": "lightkv.adapters.qwen2_5_vl:Qwen25VLAdapter",
    "internvl": "lightkv.adapters.internvl:InternVLAdapter",
    "fuyu": "lightkv.adapters.fuyu:FuyuAdapter",
    "gemma3": "lightkv.adapters.gemma3:Gemma3Adapter",
    "llava_onevision": "lightkv.adapters.llava_onevision:LlavaOnevisionAdapter",
    "llava_next_video": "lightkv.adapters.llava_next_video:LlavaNextVideoAdapter",
    "qwen2_vl": "lightkv.adapters.qwen2_vl:Qwen2VLAdapter",
    "qwen3_vl": "lightkv.adapters.qwen3_vl:Qwen3VLAdapter",
    "mistral3": "lightkv.adapters.mistral3:Mistral3Adapter",
    "pixtral": "lightkv.adapters.mistral3:PixtralLlavaAdapter",
    "idefics3": "lightkv.adapters.idefics3:Idefics3Adapter",
}
"""Family name -> ``module:class`` of its adapter (imported on first use)."""

MODEL_TYPES: dict[str, str] = {
    "llava": "llava",
    "llava_next": "llava_next",
    "qwen2_5_vl": "qwen2_5_vl",
    "internvl": "internvl",
    "internvl_chat": "internvl",
    "fuyu": "fuyu",
    "gemma3": "gemma3",
    "llava_onevision": "llava_onevision",
    "llava_next_video": "llava_next_video",
    "qwen2_vl": "qwen2_vl",
    "qwen3_vl": "qwen3_vl",
    "mistral3": "mistral3",
    "idefics3": "idefics3",
    "smolvlm": "idefics3",
}
"""``config.model_type`` -> family."""


def _load_plugin(ep: Any) -> type[Adapter] | str:
    try:
        cls = ep.load()
    except Exception as exc:  # a plugin may raise anything on import; report it, never hide others
        return f"{ep.name} = {ep.value} failed to load: {type(exc).__name__}: {exc}"
    if not (isinstance(cls, type) and issubclass(cls, Adapter)):
        return f"{ep.name} = {ep.value} is not a lightkv.adapters.Adapter subclass"
    if cls.family != ep.name:
        warnings.warn(
            f"lightkv adapter plugin {ep.name} = {ep.value} has family {cls.family!r}; "
            f"it is used under the entry-point name {ep.name!r}",
            stacklevel=3,
        )
    return cls


def plugin_adapters() -> dict[str, type[Adapter] | str]:
    """Adapters from the ``lightkv.adapters`` entry points: name -> class, or the reason it
    failed to load (each failure is also a warning)."""
    found = {}
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        key = (ep.name, ep.value)
        if key not in _PLUGINS:
            _PLUGINS[key] = _load_plugin(ep)
            if isinstance(_PLUGINS[key], str):
                warnings.warn(f"lightkv adapter plugin {_PLUGINS[key]}", stacklevel=2)
        found[ep.name] = _PLUGINS[key]
    return found


def _known() -> str:
    plugins = plugin_adapters()
    names = list(SUPPORTED_FAMILIES) + [n for n, c in plugins.items() if not isinstance(c, str)]
    failed = [c for c in plugins.values() if isinstance(c, str)]
    return ", ".join(names) + (
        "; plugins that failed to load: " + "; ".join(failed) if failed else ""
    )


def adapter_class(family: str) -> type[Adapter]:
    """The adapter class of a family (shipped, or from an entry point).

    Raises:
        ValueError: unknown family (the message lists the supported ones and the plugins
            that failed to load).
    """
    if family in SUPPORTED_FAMILIES:
        module, name = SUPPORTED_FAMILIES[family].split(":")
        return getattr(importlib.import_module(module), name)
    found = plugin_adapters().get(family)
    if isinstance(found, str):
        raise ValueError(f"adapter plugin {found}")
    if found is None:
        raise ValueError(f"unknown model family {family!r}; supported families: {_known()}")
    return found


def detect_family(model: nn.Module) -> str:
    """The family of a model, from ``model.config.model_type``.

    Raises:
        ValueError: the model type is not supported (the message lists the families).
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = MODEL_TYPES.get(model_type or "")  # None: a config without a model type
    if (
        family == "llava"
        and getattr(getattr(model.config, "vision_config", None), "model_type", None) == "pixtral"
    ):
        family = (
            "pixtral"  # Pixtral-12B: a LLaVA checkpoint whose images are laid out as Mistral3's
        )
    if family is None:
        plugins = {n: c for n, c in plugin_adapters().items() if not isinstance(c, str)}
        family = next((n for n, c in plugins.items() if model_type in c.model_types), None)
    if family is None:
        raise ValueError(
            f"lightkv has no adapter for {type(model).__name__} (model_type={model_type!r}); "
            f"supported families: {_known()} (model types: {', '.join(MODEL_TYPES)})"
        )
    return family


def get_adapter(model: nn.Module, family: str | None = None, **options: Any) -> Adapter:
    """An adapter for ``model`` (family detected unless given)."""
    return adapter_class(family or detect_family(model))(model, **options)
