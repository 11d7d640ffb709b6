"""transformers integration: compress vision tokens inside the prefill of unmodified models.

```python
from lightkv.adapters import apply
with apply(pipeline, model) as session:          # or lightkv.apply(pipeline, model)
    out = model.generate(**inputs, max_new_tokens=32)
print(session.report())
```

Supported families: see `SUPPORTED_FAMILIES`.

Modules: to add a model family read `base` (the `Adapter` class) and one family module
(e.g. `llava`), and register it in `registry`. To add a place where compression happens
(a mode) read `modes`. The rest is internals of the hooks: `session`
(`CompressionSession`, which drives the modes), `cache` (also `kv_bytes`, the bytes a cache
holds), `masks`, `features`, `guards` and `probes`; `trace` and `report` hold what a
session recorded; `attention` checks which attention implementation ran (a session must
never switch it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .base import Adapter
from .cache import MaskedCacheLayer, MaskedQuantizedLayer, kv_bytes
from .registry import SUPPORTED_FAMILIES, detect_family, get_adapter
from .session import CompressionSession
from .trace import PrefillTrace, StageRecord

__all__ = [
    "SUPPORTED_FAMILIES",
    "Adapter",
    "CompressionSession",
    "MaskedCacheLayer",
    "MaskedQuantizedLayer",
    "PrefillTrace",
    "StageRecord",
    "apply",
    "detect_family",
    "get_adapter",
    "kv_bytes",
]


def apply(
    pipeline,
    model: nn.Module,
    *,
    adapter: str | Adapter | None = None,
    record: bool = False,
    reuse_projections: bool = True,
    proportional_route: str = "auto",
    **adapter_options: Any,
) -> CompressionSession:
    """A context manager that compresses ``model``'s prefill with ``pipeline``.

    Hooks are installed on entering the ``with`` block and removed on leaving it (also on
    an exception). Inside, ``model(...)`` and ``model.generate(...)`` compress during
    prefill and decode normally afterwards.

    Args:
        pipeline: a `lightkv.Pipeline`.
        model: a supported transformers vision-language model instance.
        adapter: family name or `Adapter` (default: detected from ``model.config``).
        record: keep each stage's exact inputs (``session.records``).
        reuse_projections: read relevance from the scheduled layers' own q / k projections
            (False: project their inputs a second time, for comparisons).
        proportional_route: where proportional attention's ``log(size)`` goes: ``auto``
            (by the model's attention implementation), ``mask``, ``channel`` or ``flex``
            (`lightkv.adapters.bias`).
        **adapter_options: family options (e.g. ``newline_token_id`` for Fuyu).

    Raises:
        ValueError: unsupported model family or attention implementation, or a schedule
            that does not fit the model's depth.
    """
    return CompressionSession(
        pipeline,
        model,
        adapter=adapter,
        record=record,
        reuse_projections=reuse_projections,
        proportional_route=proportional_route,
        **adapter_options,
    )
