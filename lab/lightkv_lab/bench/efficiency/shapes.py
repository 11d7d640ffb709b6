"""The benchmark's configuration and what it builds from a model shape.

`BenchConfig` says what `lightkv_lab.bench.efficiency.run` measures; `scaled_pipeline` moves a
preset's schedule to the reduced depth (`scale_layers`); `build_model` builds a random-weight
model with a one-row prompt. The shapes themselves (`MODELS`, `ModelSpec`) are in
`lightkv_lab.bench.efficiency.specs`.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightkv.policies.schedulers import scale_layers
from lightkv_lab.bench.allocator import ALLOCATORS
from lightkv_lab.bench.efficiency.specs import MODELS, ModelSpec
from lightkv_lab.bench.paths import results_dir

__all__ = [
    "DEFAULT_PRESETS",
    "MODELS",
    "BenchConfig",
    "ModelSpec",
    "build_model",
    "preset_pipeline",
    "quick_config",
    "scaled_pipeline",
    "text_after_image",
]

PRE_TEXT, POST_TEXT = 20, 15
RESULTS = results_dir()
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTENTION = ("sdpa", "eager", "flash_attention_2")
"""Attention implementations the benchmark can load its models with (``--attn-implementation``)."""
UNCOMPRESSED = "uncompressed"
EAGER_REF = "lightkv+eager-scores"
PROJECTED = "lightkv+second-projection"


DEFAULT_PRESETS = ("lightkv", "tome", "fastv", "pdrop", "elasticcache", "h2o")
"""The compared presets; elasticcache and h2o act on the cache after prefill (TTFT unchanged is
their honest result: they save KV memory, not prefill compute)."""


@dataclass
class BenchConfig:
    """What `run` measures.

    Attributes:
        models: keys of `MODELS`.
        presets: preset names (``lightkv`` means each model's LightKV preset).
        layers: reduced decoder depth (schedules are scaled to it, see `scale_layers`).
        heads: reduced query heads (None: each model's default); width = heads x 128.
        width: ``"reduced"`` (``heads`` x 128) or ``"full"``: the real model's width, heads,
            key/value heads and MLP (only the depth is reduced; ``heads`` is then ignored).
        projection_baseline: also run LightKV projecting each scheduled layer's input a
            second time (``reuse_projections=False``, variant ``lightkv+second-projection``),
            to measure what reading the layer's own projections saves.
        internvl_tiles: tiles of the InternVL image (256 tokens each).
        repeats, warmup: timed and untimed prefills per variant.
        memory: measure peak memory (CPU: one child process per model).
        eager_reference: time the reference-style H x N x N scoring.
        eager_repeats: prefills with the reference-style scoring.
        attn_implementation: the models' attention (`ATTENTION`); every variant must run it
            (`lightkv.adapters.attention`): the uncompressed and the compressed prefills of a
            model all run it (``flash_attention_2`` too: lightkv hands its compressed
            layers 2-D padding masks there).
        device, dtype, threads: where and how (threads: torch intra-op threads; None: default).
        allocator: host memory of the timed prefills (`lightkv_lab.bench.allocator`):
            ``steady`` (default: freed memory is reused, as PyTorch's caching allocator does
            on a GPU) or ``system`` (glibc's defaults: large blocks are fresh pages each
            time, which a long prefill pays more than a short one).
        progress: show a progress bar (`lightkv_lab.bench.progress.Progress`: on a terminal only).
        quick: a short run (set by `quick_config`).
    """

    models: tuple[str, ...] = tuple(MODELS)
    presets: tuple[str, ...] = DEFAULT_PRESETS
    budgets: tuple[float, ...] = ()
    """Kept-fraction targets: each preset runs at each (variant ``preset@target``, put there
    by `lightkv_lab.bench.budgets.knob_pipeline`); empty: each preset's own schedule."""
    layers: int = 8
    heads: int | None = None
    width: str = "reduced"
    projection_baseline: bool = False
    internvl_tiles: int = 5
    repeats: int = 3
    warmup: int = 1
    memory: bool = True
    eager_reference: bool = True
    eager_repeats: int = 2
    attn_implementation: str = "sdpa"
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    allocator: str = "steady"
    progress: bool = True
    quick: bool = False

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise ValueError(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
        if not self.models:
            raise ValueError("no models to benchmark")
        if self.layers < 2:
            raise ValueError(f"layers must be at least 2, got {self.layers}")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {list(ALLOCATORS)}, got {self.allocator!r}")
        if self.width not in ("reduced", "full"):
            raise ValueError(f"width must be 'reduced' or 'full', got {self.width!r}")
        from lightkv_lab.bench.budgets import check_kept_fractions

        self.budgets = check_kept_fractions(self.budgets, "budgets (--kept-fractions)")
        if self.budgets and self.projection_baseline:
            raise ValueError(
                "projection_baseline times the lightkv preset's own schedule: run it without "
                "budgets"
            )
        if self.projection_baseline and "lightkv" not in self.presets:
            raise ValueError(
                "projection_baseline compares against the lightkv preset: include it in presets"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPES)}")
        check_attention_available(self.attn_implementation, self.device, self.dtype)
        from lightkv.presets import PRESETS

        bad = [p for p in self.presets if p not in PRESETS]
        if bad:
            raise ValueError(f"unknown preset(s) {bad}; see `lightkv presets`")
        self.models, self.presets = tuple(self.models), tuple(self.presets)

    @property
    def variants(self) -> tuple[str, ...]:
        """The compressed variants: the presets, or ``preset@target`` for each budget."""
        if not self.budgets:
            return self.presets
        return tuple(f"{p}@{b:g}" for p in self.presets for b in self.budgets)

    @property
    def compares_reference_scoring(self) -> bool:
        """The reference-style scoring runs (on the lightkv preset's own schedule)."""
        return self.eager_reference and "lightkv" in self.variants


def quick_config(**over: Any) -> BenchConfig:
    """A short run (about 2 minutes on 2 idle CPU cores): 6 layers of one 128-wide head,
    one InternVL tile, lightkv and fastv, 3 timed prefills. Token counts stay real; the
    ratios of so narrow a decoder say little about time (overheads dominate)."""
    base = {
        "layers": 6,
        "heads": 1,
        "internvl_tiles": 1,
        "presets": ("lightkv", "fastv"),
        "repeats": 3,
        "warmup": 1,
        "eager_repeats": 1,
        "quick": True,
    }
    base.update(over)
    cfg = BenchConfig(**base)
    return cfg


# ---------------------------------------------------------------------------- schedules


def _variant(name: str, spec: ModelSpec) -> tuple[str, float | None]:
    """``(preset, target)`` of a variant name (``preset`` or ``preset@target``); ``lightkv``
    is the shape's own LightKV preset."""
    preset, _, target = name.partition("@")
    return (spec.lightkv_preset if preset == "lightkv" else preset), (
        float(target) if target else None
    )


def preset_pipeline(name: str, spec: ModelSpec):
    """The variant's pipeline at the shape's reference depth."""
    return scaled_pipeline(name, spec, spec.ref["layers"])


def _at_depth(name: str, spec: ModelSpec, depth: int):
    """``(pipeline, how)`` of a variant on a ``depth``-layer decoder: the preset with its
    explicit schedule scaled from the reference depth, then (``preset@target``) put at the
    target by the library's knob (`lightkv_lab.bench.budgets.knob_pipeline`; ``how`` None
    without a target)."""
    from lightkv.policies import ExplicitSchedule
    from lightkv.presets import get_preset
    from lightkv_lab.bench.budgets import knob_pipeline

    preset, target = _variant(name, spec)
    try:
        pipe = get_preset(preset)
        sched = pipe.scheduler
        if isinstance(sched, ExplicitSchedule) and depth != spec.ref["layers"]:
            pipe = pipe.with_scheduler(
                replace(sched, layers=scale_layers(sched.layers, spec.ref["layers"], depth))
            )
        return (pipe, None) if target is None else knob_pipeline(pipe, depth, target)
    except ValueError as e:  # name the option that set the depth
        raise ValueError(
            f"preset {preset!r} on a {depth}-layer decoder (--layers {depth}): {e}"
        ) from None


def scaled_pipeline(name: str, spec: ModelSpec, depth: int):
    """The variant's pipeline for a ``depth``-layer decoder: the preset with its explicit
    schedule scaled from the reference depth, or (``preset@target``) put at the target."""
    return _at_depth(name, spec, depth)[0]


def variant_placement(name: str, spec: ModelSpec, depth: int) -> str | None:
    """How a ``preset@target`` variant reaches its target on a ``depth``-layer decoder
    (`lightkv_lab.bench.budgets.knob_pipeline`'s ``how``: ``"nearest"`` when the preset
    cannot get there); None for a preset at its own schedule."""
    if _variant(name, spec)[1] is None:  # also the variants that are no preset (PROJECTED)
        return None
    return _at_depth(name, spec, depth)[1]


# ---------------------------------------------------------------------------- models
def check_attention_available(impl: str, device: str, dtype: str) -> None:
    """Raise ``ValueError`` naming the fix when the benchmark cannot load its models with
    attention ``impl`` here: FlashAttention-2 needs a CUDA GPU, the ``flash_attn`` package and
    half precision."""
    if impl not in ATTENTION:
        raise ValueError(
            f"unknown attention implementation {impl!r}; choose from {list(ATTENTION)}"
        )
    if impl != "flash_attention_2":
        return
    if torch.device(device).type != "cuda":
        raise ValueError(
            f"attention flash_attention_2 needs a CUDA GPU (--device cuda), not {device!r}: use "
            "--attn-implementation sdpa here"
        )
    if importlib.util.find_spec("flash_attn") is None:
        raise ValueError(
            "attention flash_attention_2 needs the flash_attn package: pip install flash-attn "
            "--no-build-isolation (it compiles against the installed torch), or use "
            "--attn-implementation sdpa"
        )
    if dtype == "float32":
        raise ValueError(
            "attention flash_attention_2 runs in half precision only: pass --dtype bfloat16 "
            "(or float16)"
        )


def build_model(spec: ModelSpec, cfg: BenchConfig, attn: str | None = None):
    """``(model, inputs, sizes)``: the reduced model on the device and a one-row prompt, with
    attention ``attn`` (default: ``cfg.attn_implementation``)."""
    from lightkv_lab.tiny import TINY_MODELS

    attn = attn or cfg.attn_implementation
    sizes = spec.reduced(cfg.layers, cfg.heads, cfg.width == "full")
    fam = TINY_MODELS[spec.family]
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    # on a GPU the weights are created there (a 7B-wide decoder initialises in seconds)
    with torch.device(device) if device.type == "cuda" else contextlib.nullcontext():
        model = fam.build(
            attn_implementation=attn,
            num_layers=sizes["layers"],
            hidden_size=sizes["hidden"],
            intermediate_size=sizes["intermediate"],
            num_heads=sizes["heads"],
            num_kv_heads=sizes["kv_heads"],
            **spec.build_kwargs,
        )
    image = [cfg.internvl_tiles] if spec.family == "internvl" else spec.image
    extra = {"videos": spec.video} if spec.video is not None else {}
    row = fam.row(model, image, pre=PRE_TEXT, post=POST_TEXT, seed=0, **extra)
    inputs = fam.collate([row])
    model = model.to(device=device, dtype=dtype)
    inputs = {
        k: (v.to(device, dtype) if v.is_floating_point() else v.to(device))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in inputs.items()
    }
    return model, inputs, sizes


def text_after_image(inputs) -> int:
    """Text columns after the image or video (everything after the last vision token)."""
    from lightkv.testing import IMAGE, VIDEO

    ids = inputs["input_ids"][0]
    pos = ((ids == IMAGE) | (ids == VIDEO)).nonzero()
    return int(ids.shape[0] - 1 - pos[-1]) if pos.numel() else POST_TEXT
