"""Which attention implementation a model is configured for, and which one actually ran.

A compression stage must never switch a model to another attention implementation (e.g. eager, to
read attention weights): that would silently change the speed being measured and, for flash kernels,
the numerics. The one declared exception is the released code's quirk ``released_quirks:
{eager_merge_layers: true}`` (`lightkv.quirks.ReleasedQuirks`), which reproduces its eager merge
layers on request; a watch records those calls as ``eager``. `configured_attention` reads what the
configs say; `AttentionWatch` records what the decoder layers' attention modules dispatched during a
forward, per call, by wrapping each module's ``forward`` *on the instance* (the registry
``ALL_ATTENTION_FUNCTIONS`` and the classes are never touched) and counting, inside each call, the
``scaled_dot_product_attention`` kernels that ran (a `TorchFunctionMode` scoped to the call).
`check_same_attention` turns a difference into an `AttentionChanged` error.

Watching costs a Python round trip per torch call inside attention: use it on untimed
forwards only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "AttentionChanged",
    "AttentionWatch",
    "attention_modules",
    "check_same_attention",
    "configured_attention",
]

SDPA_WITHOUT_KERNEL = "sdpa (no sdpa kernel ran)"
"""Recorded for a call dispatched to ``sdpa`` in which no ``scaled_dot_product_attention``
ran: something inside the module computed attention another way."""


class AttentionChanged(RuntimeError):
    """A compressed run used another attention implementation than the uncompressed one."""


def configured_attention(model: nn.Module) -> dict[str, str | None]:
    """``config._attn_implementation`` of ``model.config`` (key ``""``) and of each of its
    sub-configs (``text_config``, ``vision_config``, ...), by attribute name."""
    cfg = model.config
    out = {"": getattr(cfg, "_attn_implementation", None)}
    for name in getattr(cfg, "sub_configs", None) or {}:
        sub = getattr(cfg, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out[name] = sub._attn_implementation
    return out


def attention_modules(model: nn.Module, adapter: Any = None) -> list[nn.Module]:
    """The self-attention module of each decoder layer (the family adapter finds the layers;
    every supported family calls it ``self_attn``)."""
    from .registry import get_adapter

    adapter = adapter or get_adapter(model)
    mods = [getattr(layer, "self_attn", None) for layer in adapter.decoder_layers()]
    if any(m is None for m in mods):
        raise TypeError(f"{type(model).__name__}: a decoder layer without a self_attn module")
    return cast(list[nn.Module], mods)  # no None left (checked above)


class _SdpaCounter(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` calls while active (one attention call)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


class AttentionWatch:
    """Record the attention implementation each decoder layer's attention call dispatched.

    ```python
    with AttentionWatch(model) as watch:
        model(**inputs)
    watch.ran  # {"sdpa": 32}: registry key -> calls
    ```

    A call counts under the key its module's config names at call time (the key the
    modeling code hands ``ALL_ATTENTION_FUNCTIONS.get_interface``); an ``sdpa`` call in which
    no ``scaled_dot_product_attention`` kernel ran counts as `SDPA_WITHOUT_KERNEL`.

    Args:
        model: a supported vision-language model.
        modules: the attention modules to watch (default: `attention_modules`).
    """

    def __init__(self, model: nn.Module, modules: Iterable[nn.Module] | None = None) -> None:
        self.modules = list(modules) if modules is not None else attention_modules(model)
        self.ran: Counter[str] = Counter()
        self.sdpa_kernels = 0
        self._restore: list[tuple[nn.Module, bool, Any]] = []

    def __enter__(self) -> AttentionWatch:
        for module in self.modules:
            had = "forward" in module.__dict__
            original = module.forward
            module.forward = self._wrapped(module, original)
            self._restore.append((module, had, original))
        return self

    def __exit__(self, *exc) -> None:
        for module, had, original in reversed(self._restore):
            if had:
                module.forward = original
            else:
                module.__dict__.pop("forward", None)
        self._restore.clear()

    def _wrapped(self, module: nn.Module, original):
        def forward(*args, **kwargs):
            cfg = getattr(module, "config", None)
            key = getattr(cfg, "_attn_implementation", None) or "eager"  # get_interface's default
            # a call lightkv routed (proportional attention's bias channel): the kernel that ran
            key = getattr(cfg, "lightkv_kernel", None) or key
            counter = _SdpaCounter()
            with counter:
                out = original(*args, **kwargs)
            self.sdpa_kernels += counter.calls
            self.ran[SDPA_WITHOUT_KERNEL if key == "sdpa" and counter.calls == 0 else key] += 1
            return out

        return forward

    @property
    def implementations(self) -> list[str]:
        """The implementations that ran, sorted."""
        return sorted(self.ran)

    def summary(self) -> dict[str, Any]:
        """``{"ran": {key: calls}, "sdpa_kernels": n}`` (JSON-serialisable)."""
        return {"ran": dict(sorted(self.ran.items())), "sdpa_kernels": self.sdpa_kernels}


def check_same_attention(ran: Mapping[str, Iterable[str]], reference: str) -> None:
    """Raise `AttentionChanged` when a variant ran other attention implementations than
    ``reference`` (e.g. the uncompressed run): ``ran`` maps variant names (presets) to the
    implementations each ran (`AttentionWatch.implementations`)."""
    want = sorted(ran[reference])
    for name, impls in ran.items():
        if sorted(impls) != want:
            hint = "report this as a bug of the preset's mode"
            if "eager" in impls and "eager" not in want:  # the one declared switch
                hint = (
                    "if the pipeline has released_quirks: {eager_merge_layers: true} (on in the "
                    "lightkv-paper-released presets: the released code's merge layers run eager), "
                    "turn it off "
                    "to compare speeds; otherwise " + hint
                )
            raise AttentionChanged(
                f"preset {name!r} ran attention implementation(s) {sorted(impls)} but {reference} "
                f"ran {want}: a compression stage must never change the model's attention "
                f"implementation (it changes what is measured); {hint}"
            )
