"""`MaskedQuantizedLayer`: the hole bookkeeping over a transformers quantized cache layer,
built once per quantized layer class."""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from transformers.cache_utils import DynamicLayer

try:  # transformers with the FP8 backend: every quantized layer derives from this base
    from transformers.cache_utils import BaseQuantizedLayer as _QuantizedBase
except ImportError:  # earlier releases: the group-wise (quanto, HQQ) layers only
    from transformers.cache_utils import QuantizedLayer as _QuantizedBase

from .layer import MaskedCacheLayer

__all__ = ["MaskedQuantizedLayer"]


class MaskedQuantizedLayer(MaskedCacheLayer):
    """The hole bookkeeping of `MaskedCacheLayer` over a transformers quantized cache layer.

    Not instantiated itself: `install_masked_layer` builds, once per quantized layer class
    ``Q`` (``QuantoQuantizedLayer``, ``HQQQuantizedLayer``, ...), a class
    ``Masked<Q>(MaskedQuantizedLayer, Q)`` and gives it the replaced layer's settings, so
    ``update`` is ``Q.update`` (quantized entries plus the full-precision residual) with
    the bookkeeping on top.

    What the names mean here: ``keys`` / ``values`` are ``Q``'s full-precision residual
    only (the rest lives quantized in ``_quantized_keys`` / ``_quantized_values``); the
    *entries* are what ``update`` returns (dequantized entries, residual, new states), as
    many as ``valid`` has columns (``Q.cumulative_length``); `get_seq_length` counts the
    original columns, as for every masked layer.

    Row operations go through ``Q``'s own: beam search (`reorder_cache`) where ``Q``
    reorders its quantized entries (the transformers release in use defers it to the next
    ``update``); `batch_repeat_interleave` and `batch_select_indices` (and `reorder_cache`
    where ``Q`` has no quantization-aware one) raise, because ``Q`` would move only the
    residual and leave the quantized entries in the old row order. `replace` (the cache
    mode) raises: the session refuses the cache mode with a quantized cache before it runs.
    """

    _layer_type = None  # the masked classes never enter transformers' layer-type mappings

    def update(self, key_states, value_states, *args, **kwargs):
        if self.pending_channel is not None and self.pending_sizes is not None:
            raise NotImplementedError(
                "proportional attention's bias channel (its route under FlashAttention-2) "
                "cannot be stored in a quantized cache (the channel would be quantized with the "
                "keys); use a DynamicCache, or attn_implementation='sdpa' (the mask route)"
            )
        try:
            return super().update(key_states, value_states, *args, **kwargs)
        except ValueError as err:
            # A group-wise quantizer needs its group size to divide the values it groups, whose
            # number follows the entries: a compressed layer can fail where the prompt would not.
            b, h, _, d = key_states.shape
            raise ValueError(
                f"quantizing the {self.cumulative_length} entries of compressed cache layer "
                f"{type(self).__name__} failed ({err}). A compressed layer holds fewer entries "
                "than the prompt; if the group size is the cause, choose a q_group_size that fits "
                f"any number of entries: a divisor of kv_heads * head_dim = {h * d} with axis 0, "
                f"of batch * kv_heads = {b * h} with axis -1"
            ) from err

    def _row_op(self, name: str, use: str) -> None:
        base = _quantized_class(type(self))
        if getattr(base, name) is getattr(DynamicLayer, name):
            raise NotImplementedError(
                f"{base.__name__}.{name} (transformers) moves only the full-precision residual of "
                f"a quantized cache layer, not its quantized entries, so {use} would mix rows. Use "
                f"a DynamicCache for {use}, or generate without it (num_beams=1, one sequence per "
                "prompt)"
            )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._row_op("reorder_cache", "beam search")
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._row_op("batch_repeat_interleave", "repeating the cache's rows")
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._row_op("batch_select_indices", "selecting the cache's rows")
        super().batch_select_indices(indices)

    def replace(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "a quantized cache layer cannot take rewritten entries (the cache mode: cache stages, "
            "H2O eviction) without re-quantizing them; use a DynamicCache with these pipelines"
        )


_MASKED: dict[type, type[MaskedQuantizedLayer]] = {}


def _masked_class(base: type) -> type[MaskedQuantizedLayer]:
    """``Masked<base>(MaskedQuantizedLayer, base)``, built once per quantized layer class."""
    if base not in _MASKED:
        name = f"Masked{base.__name__}"
        cls = types.new_class(
            name,
            (MaskedQuantizedLayer, base),
            exec_body=lambda ns: ns.update(
                __module__=__name__,
                __qualname__=name,
                __doc__=f"`MaskedQuantizedLayer` over `{base.__name__}`.",
            ),
        )
        _MASKED[base] = cast(type[MaskedQuantizedLayer], cls)  # a subclass by construction
    return _MASKED[base]


def _quantized_class(cls: type) -> type:
    """The transformers quantized layer class under a (possibly masked) layer class."""
    return next(
        c
        for c in cls.__mro__
        if issubclass(c, _QuantizedBase) and not issubclass(c, MaskedCacheLayer)
    )
