"""Where the compression's own time goes inside one prefill: `torch.profiler` ranges around
each of the session's hooks (layout, relevance, stage, bookkeeping; the same split as
`OverheadProbe`), and the operators that ran inside each range, by self time.

```python
from lightkv_lab.bench.efficiency import BenchConfig, MODELS
from lightkv_lab.bench.efficiency.profile import profile_prefill
cfg = BenchConfig(models=("llava_next",), layers=4, heads=2)
out = profile_prefill(MODELS["llava_next"], cfg, "lightkv")
out["parts_ms"]["stage"], out["ops"]["stage"][:3]
```
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.autograd.profiler import record_function

from lightkv_lab.bench.efficiency.measure import OverheadProbe, first_token
from lightkv_lab.bench.efficiency.shapes import (
    PROJECTED,
    BenchConfig,
    ModelSpec,
    build_model,
    scaled_pipeline,
)

__all__ = ["ProfileProbe", "profile_prefill"]

PREFIX = "lightkv/"


class ProfileProbe(OverheadProbe):
    """`OverheadProbe` whose timed ranges are also `torch.profiler` ranges named
    ``lightkv/<part>``, so the operators inside each hook can be attributed to it."""

    def __init__(self, session, sync):
        self._ranges: dict[str, Any] = {}
        super().__init__(session, sync)

    def _start(self, key):
        timed = super()._start(key)

        def hook(*a, **k):
            timed(*a, **k)
            self._ranges[key] = record_function(PREFIX + key)
            self._ranges[key].__enter__()

        return hook

    def _stop(self, key):
        timed = super()._stop(key)

        def hook(*a, **k):
            rf = self._ranges.pop(key, None)
            if rf is not None:
                rf.__exit__(None, None, None)
            timed(*a, **k)

        return hook


def _ops_inside(events) -> dict[str, dict[str, list[float]]]:
    """Self CPU time (ms) and calls of every operator under each ``lightkv/`` range."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))

    def walk(ev, part):
        for child in ev.cpu_children:
            if child.name.startswith(PREFIX):
                walk(child, child.name[len(PREFIX) :])
                continue
            if part is not None:
                acc = out[part][child.name]
                acc[0] += child.self_cpu_time_total / 1000.0
                acc[1] += 1
            walk(child, part)

    for ev in events:
        if ev.cpu_parent is None:
            if ev.name.startswith(PREFIX):
                walk(ev, ev.name[len(PREFIX) :])
            else:
                walk(ev, None)
    return out


def profile_prefill(
    spec: ModelSpec, cfg: BenchConfig, variant: str = "lightkv", top: int = 12, warmup: int = 1
) -> dict[str, Any]:
    """Profile one compressed prefill of ``spec`` (built as the efficiency benchmark builds
    it from ``cfg``) with ``variant`` (a preset, or `PROJECTED`).

    Returns:
        ``parts_ms`` (each hook family's wall time), ``prefill_ms``, ``share`` (the parts'
        sum over the prefill) and ``ops``: per part, the ``top`` operators by self CPU time
        as ``[name, ms, calls]``.
    """
    from lightkv.adapters import apply

    torch.manual_seed(0)
    model, inputs, sizes = build_model(spec, cfg)
    pipe = scaled_pipeline("lightkv" if variant == PROJECTED else variant, spec, sizes["layers"])
    nothing = lambda: None  # CPU: no device to synchronise
    with torch.no_grad():
        for _ in range(warmup):
            with apply(pipe, model, reuse_projections=variant != PROJECTED):
                first_token(model, inputs)
        with apply(pipe, model, reuse_projections=variant != PROJECTED) as session:
            probe = ProfileProbe(session, nothing)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with record_function("prefill"):
                    first_token(model, inputs)
            probe.close()
    events = prof.events()
    prefill_ms = next(e.cpu_time_total for e in events if e.name == "prefill") / 1000.0
    ops = _ops_inside(events)
    parts = {k: 1000 * v for k, v in probe.totals.items()}
    return {
        "model": spec.name,
        "variant": variant,
        "decoder": sizes,
        "prefill_ms": prefill_ms,
        "parts_ms": parts,
        "share": sum(parts.values()) / prefill_ms if prefill_ms else None,
        "ops": {
            part: sorted(
                ([n, round(ms, 3), c] for n, (ms, c) in table.items()), key=lambda r: -r[1]
            )[:top]
            for part, table in ops.items()
        },
    }
