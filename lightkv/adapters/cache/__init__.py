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
quantize it. The quanto backend needs the ``quant`` extra:

```bash
pip install "optimum-quanto>=0.2.7"   # the quant extra (in a clone: pip install ".[quant]")
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

from .install import accepts_layer, install_masked_layer, is_quantized
from .layer import (
    MaskedCacheLayer,
    _Token,  # noqa: F401  (the session and its modes import it from here)
)
from .quantized import MaskedQuantizedLayer
from .storage import kv_bytes

__all__ = [
    "MaskedCacheLayer",
    "MaskedQuantizedLayer",
    "accepts_layer",
    "install_masked_layer",
    "is_quantized",
    "kv_bytes",
]
