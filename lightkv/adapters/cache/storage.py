"""`kv_bytes`: the bytes of the keys and values a transformers cache holds, quantized or
not."""

from __future__ import annotations

from typing import Any

import torch

from .layer import MaskedCacheLayer
from .quantized import _QuantizedBase

__all__ = ["kv_bytes"]


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj``: a tensor (a quantized tensor subclass by its inner
    tensors, e.g. quanto's packed ``_data``, ``_scale``, ``_shift``), a tuple / list / dict
    of them (HQQ's ``(data, meta)``, FP8's ``(data, scale)``); anything else counts 0."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if type(obj) is not torch.Tensor and flatten is not None:
            inner, _ = flatten()
            return sum(_tensor_bytes(getattr(obj, name)) for name in inner)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o) for o in obj.values())
    return 0


def kv_bytes(cache, *, bookkeeping: bool = False) -> int:
    """The bytes of the keys and values a transformers cache holds, quantized or not.

    Per layer it counts the full-precision ``keys`` and ``values`` tensors (for a quantized
    layer: its residual) and, for a quantized layer, the storage of ``_quantized_keys`` and
    ``_quantized_values``: for quanto the inner tensors of each quantized tensor (the
    packed integer ``_data``, at its packed size, and the per-group ``_scale`` and
    ``_shift``), for HQQ the data and the tensors of its metadata (scale, zero), for FP8 the
    8-bit data and its scale. Each tensor counts ``numel * element_size`` as stored: a
    compressed layer's holes count (they are allocated), a static cache counts its whole
    allocation, allocator overhead does not.

    Args:
        cache: a transformers ``Cache`` (``DynamicCache``, ``QuantizedCache``, ...), also
            one a session compressed.
        bookkeeping: also count the hole bookkeeping of masked layers (``valid``,
            ``origin``, ``sizes`` and the cache mode's per-entry tensors), lightkv's own
            overhead over the cache.

    Raises:
        TypeError: ``cache`` is not a layered ``Cache`` (a legacy tuple cache).
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"kv_bytes needs a transformers Cache with layers; got {type(cache).__name__}"
        )
    total = 0
    for layer in layers:
        total += _tensor_bytes(getattr(layer, "keys", None)) + _tensor_bytes(
            getattr(layer, "values", None)
        )
        if isinstance(layer, _QuantizedBase):
            total += _tensor_bytes(layer._quantized_keys) + _tensor_bytes(layer._quantized_values)
        if bookkeeping and isinstance(layer, MaskedCacheLayer):
            total += _tensor_bytes([layer.valid, layer.origin, layer.sizes, layer.extra])
    return total
