"""What a `CompressionSession` refuses up front, with a clear error, because its hooks
could not work on it: a ``torch.compile``'d model (compiled code skips module hooks),
attention implementations lightkv has no masks for (FlashAttention-2 runs, on 2-D padding
masks, except where `check_flash` says why not; FlexAttention on 4-D masks), caches other
than the default dynamic one (and its quantized variant), the cache mode over a quantized
cache, and attention masks that are not 2-D.

Internals of `lightkv.adapters.session`; an adapter author does not need them (a family's
own configuration checks go in `lightkv.adapters.base.Adapter.check_config`).
"""

from __future__ import annotations

import gc
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from .cache import accepts_layer, is_quantized
from .masks import FLASH

__all__ = [
    "SUPPORTED_ATTENTION",
    "attention_implementation",
    "check_attention_mask",
    "check_flash",
    "check_cache",
    "refuse_compiled",
]

SUPPORTED_ATTENTION = ("sdpa", "eager", FLASH, "flex_attention")
"""Attention implementations the hooks support: a 4-D mask per compressed layer (sdpa, eager;
``flex_attention`` takes the additive float form, which transformers adds in its
``score_mod``) or a 2-D padding mask per compressed layer over compacted rows
(FlashAttention-2)."""


def attention_implementation(config: Any) -> str:
    """The decoder's attention implementation (``config._attn_implementation``, default
    ``"eager"``).

    Raises:
        ValueError: it is not in `SUPPORTED_ATTENTION`.
    """
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        why = (
            "lightkv's 2-D padding masks are checked against FlashAttention-2's contract only, "
            f"not {impl}'s"
            if "flash" in impl
            else "the compressed layers need a mask lightkv builds (4-D, or FlashAttention-2's "
            "2-D padding mask), and this implementation takes neither"
        )
        raise ValueError(
            f"lightkv needs attn_implementation in {SUPPORTED_ATTENTION}; this model uses "
            f"{impl!r}: {why}. Load it with attn_implementation='sdpa', 'flash_attention_2' or "
            "'flex_attention' (or "
            "model.set_attn_implementation(...)); in the efficiency benchmark pass "
            "--attn-implementation sdpa."
        )
    return impl


def check_flash(impl: str, adapter: Any, attention: Sequence[nn.Module | None]) -> None:
    """Refuse, under FlashAttention-2, what its kernels cannot compute on a compressed
    sequence (nothing happens under another ``impl``). Proportional attention is not
    refused: it takes the channel route (`lightkv.adapters.bias`).

    Args:
        impl: the decoder's attention implementation.
        adapter: the family adapter (its `Adapter.flash_attention_refused`).
        attention: the decoder layers' self-attention modules (their ``sliding_window``; None
            for a layer without one).

    Raises:
        ValueError: the family or a sliding-window layer.
    """
    if impl != FLASH:
        return
    fix = "; load the model with attn_implementation='sdpa' to compress it"
    reason = type(adapter).flash_attention_refused
    if reason:
        raise ValueError(
            f"lightkv cannot compress the {adapter.family!r} family under flash_attention_2: "
            f"{reason}" + fix
        )
    windowed = [i for i, m in enumerate(attention) if getattr(m, "sliding_window", None)]
    if windowed:
        raise ValueError(
            "lightkv cannot compress under flash_attention_2 a model with sliding-window layers "
            f"{windowed}: the kernel measures the window in columns of the compacted row, not in "
            "the original positions the "
            "dropped tokens leave gaps in" + fix
        )


_STATIC_WHY = (
    "after compression every layer holds its own number of entries, with holes, and transformers "
    "builds one decoding mask for all layers of a static cache, so lightkv must give each layer "
    "its own growing mask, which CUDA graphs cannot capture"
)
"""Why a static cache cannot hold a compressed prefill (the refusal names it)."""


def check_cache(
    cache: Any, allowed: tuple[type, ...] = (DynamicLayer,), rewritten: Collection[int] = ()
) -> None:
    """Refuse a cache the session cannot mask: a legacy tuple cache, or a `Cache` with
    layers it does not accept (`lightkv.adapters.cache.accepts_layer`: exact ``allowed``
    types, the adapter's ``cache_layer_types``; quantized layers where `DynamicLayer` is
    allowed; masked layers), i.e. static, sliding-window, offloaded; and a quantized layer
    among the ``rewritten`` ones (the cache mode's layers, whose entries are replaced after
    they ran). ``None`` (no cache yet) passes."""
    if cache is not None and not isinstance(cache, Cache):
        raise TypeError(
            "lightkv supports transformers Cache objects only (legacy tuple caches are not "
            "supported)"
        )
    if cache is None:
        return
    layers = getattr(cache, "layers", ())
    bad = next((layer for layer in layers if not accepts_layer(layer, allowed)), None)
    if bad is not None:
        raise TypeError(
            "lightkv supports the default dynamic cache only (and QuantizedCache, its quantized "
            f"variant); this {type(cache).__name__} has {type(bad).__name__} layers (static, "
            "sliding-window and offloaded caches are not supported: "
            + _STATIC_WHY
            + "): drop cache_implementation= or past_key_values="
        )
    quantized = sorted(i for i in rewritten if i < len(layers) and is_quantized(layers[i]))
    if quantized:
        raise TypeError(
            "the cache mode (cache stages, H2O eviction) replaces the entries of cache layers "
            f"{quantized} after they ran, which this {type(cache).__name__}'s "
            f"{type(layers[quantized[0]]).__name__} layers cannot take without re-quantizing them: "
            "use a DynamicCache with this pipeline (or a hidden-state schedule with the quantized "
            "cache)"
        )


def check_attention_mask(mask2d: Any) -> None:
    """Refuse an ``attention_mask`` that is not a 2-D ``[batch, sequence]`` tensor (``None``
    passes)."""
    if mask2d is not None and (not isinstance(mask2d, torch.Tensor) or mask2d.dim() != 2):
        raise ValueError(
            "lightkv needs a 2-D attention_mask [batch, sequence] (or none); got a "
            f"{mask2d.dim()}-D mask. Pass the processor's attention_mask as it is"
            if isinstance(mask2d, torch.Tensor)
            else "lightkv needs a 2-D attention_mask [batch, sequence] (or none); got "
            f"{type(mask2d).__name__}"
        )


_COMPILED = (
    "lightkv cannot compress a torch.compile'd model: compiled code does not run the hooks "
    "lightkv installs, so nothing would be compressed. "
)


def refuse_compiled(model: nn.Module, modules: Sequence[nn.Module] = ()) -> None:
    """Raise when ``model`` (or one of ``modules``) is compiled or wrapped by
    ``torch.compile``: a compiled graph skips module hooks, so a session would silently
    compress nothing."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # noqa: BLE001  (a torch without dynamo cannot compile either)
        return
    if isinstance(model, OptimizedModule):
        raise TypeError(
            _COMPILED
            + "Apply lightkv to the uncompiled model (compiled._orig_mod) and call that one "
            "inside the with block."
        )
    targets = [model, *modules]
    for m in targets:
        if getattr(m, "_compiled_call_impl", None) is not None:
            raise TypeError(
                _COMPILED + f"{type(m).__name__} was compiled in place (module.compile()); set its "
                "_compiled_call_impl to None, or load the model again, before applying lightkv."
            )
    if modules:
        # A wrapper made by torch.compile(model) keeps the model as its `_orig_mod`: calling the
        # wrapper inside the session would run the compiled graph, without hooks.
        def wrapped() -> bool:
            return any(
                isinstance(ref, dict) and any(ref.get("_orig_mod") is t for t in targets)
                for ref in gc.get_referrers(*targets)
            )

        if wrapped():
            gc.collect()  # a deleted wrapper may only wait for the cycle collector
            if wrapped():
                raise TypeError(
                    _COMPILED + "A torch.compile wrapper of this model exists; delete it "
                    "and call the uncompiled model inside the with block."
                )
