"""`MaskedCacheLayer`: the cache layer of a compressed decoder layer, which remembers
which of its entries are holes; its quantized variants; and `kv_bytes`, the bytes a cache
holds.

Internals of `lightkv.adapters.session` (an adapter author does not need it); read it to
see how the hole masks follow the cache through beam search and why cropping is refused.

**Quantized caches.** A transformers ``QuantizedCache`` (KIVI-style: quantized entries
plus a short full-precision residual) composes with a session: at a compressed layer its
quantized layer (e.g. ``QuantoQuantizedLayer``) becomes a `MaskedQuantizedLayer`: a
masked subclass of its own class with its settings (``nbits``, axes, ``q_group_size``,
``residual_length``, backend), so the shorter prompt is quantized as the layer would
quantize it. The quanto
backend needs the ``quant`` extra:

```bash
pip install "lightkv[quant]"   # optimum-quanto
```

then pass ``cache=QuantizedCache("quanto", model.config, ...)`` (or
``cache_implementation="quantized", cache_config={"backend": "quanto", ...}``) to
``model.generate`` inside the session. The HQQ backend needs ``hqq`` installed instead,
FP8 nothing. What does not compose is refused with an error that names the fix: the cache
mode (cache stages, H2O eviction), which rewrites a layer's entries after the layer ran;
row operations a quantized layer would apply to its residual only; a ``q_group_size``
that does not divide a compressed layer's values. quanto takes ``nbits`` 2 or 4, and on
CPU compiles a small C++ extension the first time it dequantizes (once per environment).
`kv_bytes` counts what such a cache really stores.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

try:  # transformers with the FP8 backend: every quantized layer derives from this base
    from transformers.cache_utils import BaseQuantizedLayer as _QuantizedBase
except ImportError:  # earlier releases: the group-wise (quanto, HQQ) layers only
    from transformers.cache_utils import QuantizedLayer as _QuantizedBase

__all__ = [
    "MaskedCacheLayer",
    "MaskedQuantizedLayer",
    "accepts_layer",
    "install_masked_layer",
    "is_quantized",
    "kv_bytes",
]


class _Token:
    """Shared open/closed flag of one session."""

    def __init__(self) -> None:
        self.open = True


class MaskedCacheLayer(DynamicLayer):
    """A `DynamicLayer` of a compressed decoder layer: shorter than the prompt, possibly
    with holes (rows that kept fewer tokens, input padding), recorded in ``valid``.

    ``valid`` (``[B, L]`` bool, True for real entries) and ``origin`` (``[B, L]`` long, the
    original sequence column of each entry, ``-1`` for holes; what a sliding window is
    measured in) and, with proportional attention, ``sizes`` (``[B, L]`` long, how many
    original tokens each entry stands for; None while every entry stands for one) follow
    the cache through beam search (`reorder_cache`), `batch_select_indices` and
    `batch_repeat_interleave`.
    Cropping is refused: compressed layers hold different numbers of entries, so "remove
    the last k tokens" has no single meaning (assisted decoding is not supported).
    """

    is_croppable = False

    def __init__(self, token: _Token | None = None):
        super().__init__()
        self._start(token)

    def _start(self, token: _Token | None) -> None:
        """The hole bookkeeping, empty (also for a quantized layer built from an existing one)."""
        self.valid: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        self.origin: torch.Tensor | None = None
        self.pending_origin: torch.Tensor | None = None
        self.columns: int | None = None
        self.pending_columns: int | None = None  # the prompt's original width, set at prefill
        self.sizes: torch.Tensor | None = None
        self.pending_sizes: torch.Tensor | None = (
            None  # set at prefill when a token stands for several
        )
        self.extra: dict[str, torch.Tensor] = {}
        """``[B, ...]`` tensors of the cache mode (H2O's accumulated scores, candidates and
        budgets) that follow the rows through beam search like ``valid``."""
        self._token = token or _Token()

    def update(self, key_states, value_states, *args, **kwargs):
        if not self._token.open:
            raise RuntimeError(
                "this cache was compressed by a lightkv session that has ended; its compressed layers need the "
                "session's masks: decode inside the `with lightkv.apply(pipeline, model):` block"
            )
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        new = self.pending
        if new is None:
            new = torch.ones(
                key_states.shape[0],
                key_states.shape[-2],
                dtype=torch.bool,
                device=key_states.device,
            )
        self.pending = None
        new = new.to(keys.device)
        self.valid = new if self.valid is None else torch.cat([self.valid, new], dim=1)
        org = self.pending_origin
        self.pending_origin = None
        if org is not None:
            org = org.to(keys.device)
            self.origin = org if self.origin is None else torch.cat([self.origin, org], dim=1)
        sizes, self.pending_sizes = self.pending_sizes, None
        if sizes is not None:
            self.sizes = sizes.to(keys.device)
        elif self.sizes is not None:  # decoded tokens stand for themselves
            one = torch.ones(new.shape, dtype=self.sizes.dtype, device=self.sizes.device)
            self.sizes = torch.cat([self.sizes, one], dim=1)
        # Counted on the host (no device sync on the decode path): the prompt's width, then
        # one column per new token.
        if self.pending_columns is not None:
            self.columns, self.pending_columns = self.pending_columns, None
        elif self.columns is not None:
            self.columns += key_states.shape[-2]
        return keys, values

    def get_seq_length(self) -> int:
        """The original sequence columns seen so far (the prompt's, then one per decoded
        token), not the entries held: the model numbers new tokens' positions from it, so
        with every layer compressed (the pre-LLM mode) decoding continues at the right
        position."""
        return self.columns if self.columns is not None else super().get_seq_length()

    def replace(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid: torch.Tensor,
        origin: torch.Tensor,
        sizes: torch.Tensor | None = None,
    ) -> None:
        """Put a compressed cache in place (the cache mode, after the layer's prefill or a
        decoding step): ``[B, H_kv, L', d]`` keys and values with their ``[B, L']`` validity,
        original columns and, for proportional attention, sizes (None: every entry stands
        for one). ``columns`` (the original columns seen) does not change."""
        if keys.shape[2] != valid.shape[1] or valid.shape != origin.shape:
            raise ValueError("keys, valid and origin disagree on the number of entries")
        if sizes is not None and sizes.shape != valid.shape:
            raise ValueError("sizes and valid disagree on the number of entries")
        self.keys, self.values = keys, values
        self.valid, self.origin = valid.bool(), origin.long()
        self.sizes = None if sizes is None else sizes.long()

    def _rows(self, fn) -> None:
        if self.valid is not None:
            self.valid = fn(self.valid)
        if self.origin is not None:
            self.origin = fn(self.origin)
        if self.sizes is not None:
            self.sizes = fn(self.sizes)
        self.extra = {k: fn(v) for k, v in self.extra.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._rows(lambda t: t[indices.to(t.device)])

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError(
            "a lightkv-compressed cache cannot be cropped (compressed layers hold fewer entries than the prompt); "
            "assisted / speculative decoding and cache rollback are not supported inside a compression session"
        )

    def reset(self) -> None:
        super().reset()
        self.valid = self.pending = self.origin = self.pending_origin = None
        self.columns = self.pending_columns = None
        self.sizes = self.pending_sizes = None
        self.extra = {}


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
        try:
            return super().update(key_states, value_states, *args, **kwargs)
        except ValueError as err:
            # A group-wise quantizer needs its group size to divide the values it groups, whose
            # number follows the entries: a compressed layer can fail where the prompt would not.
            b, h, _, d = key_states.shape
            raise ValueError(
                f"quantizing the {self.cumulative_length} entries of compressed cache layer "
                f"{type(self).__name__} failed ({err}). A compressed layer holds fewer entries than the prompt; "
                "if the group size is the cause, choose a q_group_size that fits any number of entries: "
                f"a divisor of kv_heads * head_dim = {h * d} with axis 0, of batch * kv_heads = {b * h} with axis -1"
            ) from err

    def _row_op(self, name: str, use: str) -> None:
        base = _quantized_class(type(self))
        if getattr(base, name) is getattr(DynamicLayer, name):
            raise NotImplementedError(
                f"{base.__name__}.{name} (transformers) moves only the full-precision residual of a quantized cache "
                f"layer, not its quantized entries, so {use} would mix rows. Use a DynamicCache for {use}, or "
                "generate without it (num_beams=1, one sequence per prompt)"
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
            "a quantized cache layer cannot take rewritten entries (the cache mode: cache stages, H2O eviction) "
            "without re-quantizing them; use a DynamicCache with these pipelines"
        )


_MASKED: dict[type, type] = {}


def _masked_class(base: type) -> type:
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
        _MASKED[base] = cls
    return _MASKED[base]


def _quantized_class(cls: type) -> type:
    """The transformers quantized layer class under a (possibly masked) layer class."""
    return next(
        c
        for c in cls.__mro__
        if issubclass(c, _QuantizedBase) and not issubclass(c, MaskedCacheLayer)
    )


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
                f"lightkv supports DynamicCache and QuantizedCache full-attention layers only; cache layer {i} is "
                f"{type(old).__name__} (static, sliding-window and offloaded caches are not supported)"
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
