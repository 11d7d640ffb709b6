"""Putting masked layers into a cache at prefill: which layers a session accepts, and the
masked layer (plain or quantized) that takes each one's place."""

from __future__ import annotations

from transformers.cache_utils import DynamicLayer

from .layer import MaskedCacheLayer, _Token
from .quantized import _masked_class, _quantized_class, _QuantizedBase

__all__ = ["accepts_layer", "install_masked_layer", "is_quantized"]


def _masked_like(old, token: _Token) -> MaskedCacheLayer:
    """The masked layer that takes the place of the empty layer ``old``."""
    if not isinstance(old, _QuantizedBase):
        return MaskedCacheLayer(token)
    cls = _masked_class(
        _quantized_class(type(old))
    )  # also for a reset masked layer of a former prefill
    new = cls.__new__(cls)
    # The empty layer's own attributes are its quantization settings (nbits, axes, group size,
    # residual length, backend objects): copied rather than passed to a constructor, so any
    # quantized layer class works, whatever its constructor takes.
    vars(new).update(vars(old))
    new._start(token)
    return new


def accepts_layer(layer, allowed: tuple[type, ...]) -> bool:
    """Whether a session may mask cache layer ``layer``: an exact ``allowed`` type, a
    quantized layer (``QuantizedLayer`` and the like) where plain `DynamicLayer` is
    allowed (it is one, with lossy storage), or a layer it already masked."""
    return (
        type(layer) in allowed
        or isinstance(layer, MaskedCacheLayer)
        or (DynamicLayer in allowed and isinstance(layer, _QuantizedBase))
    )


def is_quantized(layer) -> bool:
    """Whether ``layer`` stores its entries quantized (a transformers quantized layer)."""
    return isinstance(layer, _QuantizedBase)


def install_masked_layer(
    cache, i: int, token: _Token, allowed: tuple[type, ...]
) -> MaskedCacheLayer:
    """Put a fresh masked layer at layer ``i`` of ``cache`` at prefill, in place of an empty
    layer the session accepts (`accepts_layer`), or appended, for a cache that grows layer
    by layer: a `MaskedQuantizedLayer` of the same class and settings for a quantized
    layer, a `MaskedCacheLayer` otherwise.

    Raises:
        TypeError: a cache layer lightkv cannot replace (static, offloaded ...).
        RuntimeError: the layer already holds entries at prefill.
    """
    layers = cache.layers
    if len(layers) > i:
        old = layers[i]
        if not accepts_layer(old, allowed):
            raise TypeError(
                "lightkv supports DynamicCache and QuantizedCache full-attention layers only; "
                f"cache layer {i} is {type(old).__name__} (static, sliding-window and offloaded "
                "caches are not supported)"
            )
        if old.get_seq_length() > 0:
            raise RuntimeError(f"cache layer {i} is not empty at prefill")
        new = _masked_like(old, token)
        layers[i] = new
    elif len(layers) == i and getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        new = MaskedCacheLayer(token)
        layers.append(new)
    else:
        raise TypeError(f"unexpected cache structure at layer {i} ({type(cache).__name__})")
    return new
