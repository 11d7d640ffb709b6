"""KV bytes with lightkv, with KV quantization, and with both: the cache a prefill leaves,
per benchmarked model shape, for transformers' ``QuantizedCache`` backends.

For each shape (the reduced models of `lightkv_lab.bench.efficiency.shapes`; bytes scale with
width, the ratios do not) one prefill per variant fills a cache, and
`lightkv.adapters.kv_bytes` counts what it holds: a ``DynamicCache`` uncompressed (the
reference) and with LightKV; for each quantized backend that can run here (``fp8`` needs
nothing, ``quanto-4`` / ``quanto-2`` the ``quant`` extra) the same two. Every ratio is
against the uncompressed dynamic cache. Bytes only, no timing: run with
``lightkv bench kvquant``.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BACKENDS", "KVQuantConfig", "available_backends", "kvquant_markdown", "run_kvquant"]

BACKENDS: dict[str, dict[str, Any]] = {
    "fp8": {"backend": "fp8"},
    "quanto-4": {"backend": "quanto", "nbits": 4, "q_group_size": 64},
    "quanto-2": {"backend": "quanto", "nbits": 2, "q_group_size": 64},
}
"""Quantized-cache settings by name: ``QuantizedCache(**settings, config=...)`` (groups of 64
along the head dimension fit any number of entries)."""


def available_backends() -> list[str]:
    """The `BACKENDS` that can run in this environment."""
    have_quanto = (
        importlib.util.find_spec("optimum") is not None
        and importlib.util.find_spec("optimum.quanto") is not None
    )
    return [n for n, s in BACKENDS.items() if s["backend"] != "quanto" or have_quanto]


@dataclass
class KVQuantConfig:
    """What `run_kvquant` measures.

    Attributes:
        models: keys of `lightkv_lab.bench.efficiency.MODELS`.
        backends: names in `BACKENDS` (default: every available one).
        layers, heads: the reduced decoder (as in the efficiency benchmark).
    """

    models: tuple[str, ...] = ("llava", "llava_next", "qwen2_5_vl")
    backends: tuple[str, ...] | None = None
    layers: int = 8
    heads: int | None = None

    def __post_init__(self) -> None:
        from lightkv_lab.bench.efficiency.shapes import MODELS

        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise ValueError(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
        bad = [b for b in (self.backends or ()) if b not in BACKENDS]
        if bad:
            raise ValueError(f"unknown backend(s) {bad}; choose from {sorted(BACKENDS)}")
        missing = [b for b in (self.backends or ()) if b not in available_backends()]
        if missing:
            raise ValueError(
                f"backend(s) {missing} need optimum-quanto: pip install 'optimum-quanto>=0.2.7' "
                "(the lightkv[quant] extra)"
            )
        self.models = tuple(self.models)
        self.backends = tuple(self.backends) if self.backends else tuple(available_backends())


def _bytes_after_prefill(model, inputs, cache, pipe) -> int:
    from lightkv.adapters import apply, kv_bytes

    with torch.no_grad():
        if pipe is None:
            model(**inputs, cache=cache, use_cache=True, logits_to_keep=1)
        else:
            with apply(pipe, model):
                model(**inputs, cache=cache, use_cache=True, logits_to_keep=1)
    return kv_bytes(cache)


def run_kvquant(cfg: KVQuantConfig | None = None) -> dict[str, Any]:
    """KV bytes per model and variant, with ratios to the uncompressed dynamic cache."""
    from transformers.cache_utils import DynamicCache, QuantizedCache

    from lightkv_lab.bench.efficiency.shapes import (
        MODELS,
        BenchConfig,
        build_model,
        scaled_pipeline,
    )

    cfg = cfg or KVQuantConfig()
    t0 = time.perf_counter()
    bench = BenchConfig(
        models=cfg.models, layers=cfg.layers, heads=cfg.heads, memory=False, progress=False
    )
    out: dict[str, Any] = {
        "config": {
            "models": list(cfg.models),
            "backends": list(cfg.backends),
            "layers": cfg.layers,
            "heads": cfg.heads,
        },
        "settings": {b: BACKENDS[b] for b in cfg.backends},
        "models": {},
    }
    for name in cfg.models:
        spec = MODELS[name]
        torch.manual_seed(0)
        model, inputs, sizes = build_model(spec, bench)
        pipe = scaled_pipeline("lightkv", spec, sizes["layers"])
        text = model.config.get_text_config()
        rows: dict[str, int] = {}
        for label, make in [
            ("dynamic", lambda m=model: DynamicCache(config=m.config)),
            *[
                (b, lambda b=b, t=text: QuantizedCache(config=t, **BACKENDS[b]))
                for b in cfg.backends
            ],
        ]:
            rows[label] = _bytes_after_prefill(model, inputs, make(), None)
            rows[f"{label}+lightkv"] = _bytes_after_prefill(model, inputs, make(), pipe)
        base = rows["dynamic"]
        out["models"][name] = {
            "title": spec.title,
            "decoder": dict(sizes, head_dim=128),
            "kv_bytes": rows,
            "ratio": {k: v / base for k, v in rows.items()},
        }
        model = None
    out["seconds"] = time.perf_counter() - t0
    return out


def kvquant_markdown(result: dict[str, Any]) -> str:
    """One row per model: KV bytes of each variant as a fraction of the uncompressed cache."""
    labels = list(next(iter(result["models"].values()))["ratio"])
    lines = [
        "KV bytes after prefill, as a fraction of the uncompressed `DynamicCache` (bytes from "
        "`lightkv.adapters.kv_bytes`: quantized storage with its scales, plus any full-precision "
        "residual):",
        "",
        "| model | " + " | ".join(f"`{x}`" for x in labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for name, m in result["models"].items():
        lines.append(f"| {name} | " + " | ".join(f"{m['ratio'][x]:.3f}" for x in labels) + " |")
    lines += ["", "Settings: " + "; ".join(f"`{b}`: {s}" for b, s in result["settings"].items())]
    return "\n".join(lines) + "\n"
