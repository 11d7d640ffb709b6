"""Prefill efficiency side by side: uncompressed vs each preset, per model shape.

For model shapes of LLaVA-1.5-7B (576 vision tokens), LLaVA-NeXT-7B (2,928), Qwen2.5-VL-7B
(1,024) and InternVL3-8B (tiles of 256), random-weight models with the *real* vision-token
counts and the real head dimension (128), MLP ratio and grouped-query ratio are run with a
*reduced* decoder (default 8 layers, 4 or 7 heads: width 512 or 896; see `MODELS`), and
for each variant (no compression, then every preset) this measures:

* **FLOPs**: analytic prefill FLOPs of the language model (`session.report()`: per layer
  projections + attention + MLP at the layer's real length, plus the relevance
  projections), their ratio, and the same ratio for the full-size reference decoder with
  the preset's unscaled schedule (token counts per stage taken from the run);
* **KV bytes**: total and vision KV bytes read from the cache tensors the prefill returns;
* **TTFT**: a prefill that fills the cache and returns the first token, median of
  ``repeats`` runs after ``warmup`` runs, variants interleaved (CUDA events on a GPU);
* **peak memory** of the prefill above the loaded model (CPU: the kernel's resident-set
  high-water mark ``VmHWM``, reset through ``/proc/self/clear_refs`` before each prefill,
  in a child process whose glibc returns every allocation of 256 KiB or more to the system
  on free (``MALLOC_MMAP_THRESHOLD_``), so the high-water mark follows the live tensors;
  CUDA: ``max_memory_allocated``);
* **overhead** of the compression inside the prefill (timing hooks around the session's
  own hooks: layout, relevance, stage = graph + merge + new masks, per-layer bookkeeping)
  as a share of the prefill;
* **reference-style scoring**: at each merge layer, the full ``[B, H, N, N]`` attention
  matrix from the layer's own queries and keys, softmax over the query axis, reduced to
  per-vision-token relevance as the authors' code does (which runs eager attention at
  merge layers), timed and measured for memory next to our relevance.

```python
from lightkv.bench.efficiency import BenchConfig, run
result = run(BenchConfig(models=("llava",), presets=("lightkv",), quick=True))
```
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

__all__ = ["MODELS", "BenchConfig", "ModelSpec", "markdown_table", "run", "scale_layers", "write_outputs"]

HEAD_DIM = 128
PRE_TEXT, POST_TEXT = 20, 15
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNCOMPRESSED = "uncompressed"
EAGER_REF = "lightkv+eager-scores"


# ---------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked model shape.

    Attributes:
        name: key (``--models``).
        title: the real model this imitates.
        family: `lightkv.testing.FAMILIES` key.
        ref: the real decoder: layers, hidden, heads, kv_heads, intermediate.
        heads, kv_heads: reduced attention heads (head_dim 128 kept); width = heads x 128.
        lightkv_preset: what the preset name ``lightkv`` means for this model.
        image: builder arguments giving the real vision-token count.
    """

    name: str
    title: str
    family: str
    ref: dict[str, int]
    heads: int
    kv_heads: int
    lightkv_preset: str
    build_kwargs: dict[str, Any]
    image: Any
    image_note: str

    def reduced(self, layers: int, heads: int | None = None) -> dict[str, int]:
        heads = heads or self.heads
        kv = max(1, heads * self.ref["kv_heads"] // self.ref["heads"])
        hidden = heads * HEAD_DIM
        inter = round(hidden * self.ref["intermediate"] / self.ref["hidden"] / 16) * 16
        return {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv, "intermediate": inter}


MODELS: dict[str, ModelSpec] = {
    "llava": ModelSpec(
        "llava", "LLaVA-1.5-7B", "llava",
        {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 32, "intermediate": 11008},
        heads=4, kv_heads=4, lightkv_preset="lightkv",
        build_kwargs={"image_size": 48, "patch_size": 2}, image=1,
        image_note="one 24x24 image (576 tokens)",
    ),
    "llava_next": ModelSpec(
        "llava_next", "LLaVA-NeXT-7B (Vicuna)", "llava_next",
        {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 32, "intermediate": 11008},
        heads=4, kv_heads=4, lightkv_preset="lightkv",
        build_kwargs={"image_size": 48, "patch_size": 2, "pinpoints": ((96, 96), (48, 96), (96, 48))},
        image=[(96, 96)],
        image_note="a 2x2-tile image: 24x24 base grid + 48x48 high-res grid with 48 row newlines (2,928 tokens)",
    ),
    "qwen2_5_vl": ModelSpec(
        "qwen2_5_vl", "Qwen2.5-VL-7B", "qwen2_5_vl",
        {"layers": 28, "hidden": 3584, "heads": 28, "kv_heads": 4, "intermediate": 18944},
        heads=7, kv_heads=1, lightkv_preset="lightkv-qwen2_5_vl",
        build_kwargs={"patch_size": 2}, image=[(1, 64, 64)],
        image_note="a 64x64-patch image, 2x2 merge: 32x32 grid (1,024 tokens)",
    ),
    "internvl": ModelSpec(
        "internvl", "InternVL3-8B (Qwen2.5-7B decoder)", "internvl",
        {"layers": 28, "hidden": 3584, "heads": 28, "kv_heads": 4, "intermediate": 18944},
        heads=7, kv_heads=1, lightkv_preset="lightkv",
        build_kwargs={"image_size": 64, "patch_size": 2}, image=[5],
        image_note="5 tiles of 16x16 (2x2 tiles + thumbnail, 1,280 tokens)",
    ),
}
DEFAULT_PRESETS = ("lightkv", "tome", "fastv", "pdrop")


@dataclass
class BenchConfig:
    """What `run` measures.

    Attributes:
        models: keys of `MODELS`.
        presets: preset names (``lightkv`` means each model's LightKV preset).
        layers: reduced decoder depth (schedules are scaled to it, see `scale_layers`).
        heads: reduced query heads (None: each model's default); width = heads x 128.
        internvl_tiles: tiles of the InternVL image (256 tokens each).
        repeats, warmup: timed and untimed prefills per variant.
        memory: measure peak memory (CPU: one child process per model).
        eager_reference: time the reference-style H x N x N scoring.
        eager_repeats: prefills with the reference-style scoring.
        device, dtype, threads: where and how (threads: torch intra-op threads; None: default).
        progress: show a progress bar (tqdm when installed, else plain lines).
        quick: a short run (set by `quick_config`).
    """

    models: tuple[str, ...] = tuple(MODELS)
    presets: tuple[str, ...] = DEFAULT_PRESETS
    layers: int = 8
    heads: int | None = None
    internvl_tiles: int = 5
    repeats: int = 5
    warmup: int = 1
    memory: bool = True
    eager_reference: bool = True
    eager_repeats: int = 3
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
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
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPES)}")
        from ..presets import PRESETS

        bad = [p for p in self.presets if p not in PRESETS]
        if bad:
            raise ValueError(f"unknown preset(s) {bad}; see `lightkv presets`")
        self.models, self.presets = tuple(self.models), tuple(self.presets)


def quick_config(**over: Any) -> BenchConfig:
    """A short run (about 2 minutes on 2 idle CPU cores): 6 layers of one 128-wide head,
    one InternVL tile, lightkv and fastv, 3 timed prefills. Token counts stay real; the
    ratios of so narrow a decoder say little about time (overheads dominate)."""
    base = {"layers": 6, "heads": 1, "internvl_tiles": 1, "presets": ("lightkv", "fastv"), "repeats": 3, "warmup": 1,
                "eager_repeats": 1, "quick": True}
    base.update(over)
    cfg = BenchConfig(**base)
    return cfg


# ---------------------------------------------------------------------------- schedules
def scale_layers(layers: Sequence[int], ref_depth: int, depth: int) -> tuple[int, ...]:
    """Stage layers of a ``ref_depth``-layer schedule moved to a ``depth``-layer decoder.

    A stage after 0-based layer ``l`` leaves ``l + 1`` layers uncompressed by it; that
    count is scaled by ``depth / ref_depth`` and rounded (at least 1, strictly increasing,
    the last stage before the last layer), so each level of the KV step keeps about the
    same share of the layers. 12/18/24 of 32 -> 2/4/5 of 8 (LLaVA), 12/17/22 of 28 ->
    3/4/6 of 8 (Qwen2.5-VL).
    """
    out: list[int] = []
    for l in layers:
        kept = max(1, round((l + 1) * depth / ref_depth))
        if out:
            kept = max(kept, out[-1] + 2)
        out.append(kept - 1)
    if out and out[-1] > depth - 2:
        raise ValueError(f"schedule {list(layers)} of {ref_depth} layers does not fit {depth} layers")
    return tuple(out)


def _preset(name: str, spec: ModelSpec):
    from ..pipeline import Pipeline

    return Pipeline.from_preset(spec.lightkv_preset if name == "lightkv" else name)


def scaled_pipeline(name: str, spec: ModelSpec, depth: int):
    """The preset for ``spec`` with its explicit schedule scaled from the reference depth."""
    from ..policies import ExplicitSchedule

    pipe = _preset(name, spec)
    sched = pipe.scheduler
    if isinstance(sched, ExplicitSchedule) and depth != spec.ref["layers"]:
        pipe = pipe.with_scheduler(replace(sched, layers=scale_layers(sched.layers, spec.ref["layers"], depth)))
    return pipe


# ---------------------------------------------------------------------------- models
def build_model(spec: ModelSpec, cfg: BenchConfig, attn: str = "sdpa"):
    """``(model, inputs, sizes)``: the reduced model on the device and a one-row prompt."""
    from ..testing import FAMILIES

    sizes = spec.reduced(cfg.layers, cfg.heads)
    fam = FAMILIES[spec.family]
    model = fam.build(attn_implementation=attn, num_layers=sizes["layers"], hidden_size=sizes["hidden"],
                      intermediate_size=sizes["intermediate"], num_heads=sizes["heads"],
                      num_kv_heads=sizes["kv_heads"], **spec.build_kwargs)
    image = [cfg.internvl_tiles] if spec.family == "internvl" else spec.image
    row = fam.row(model, image, pre=PRE_TEXT, post=POST_TEXT, seed=0)
    inputs = fam.collate([row])
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    model = model.to(device=device, dtype=dtype)
    inputs = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) if isinstance(v, torch.Tensor)
              else v for k, v in inputs.items()}
    return model, inputs, sizes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache(out):
    c = out.get("cache") if hasattr(out, "get") else None
    return c if c is not None else out.past_key_values


def first_token(model, inputs):
    """One prefill as ``generate`` does it: fill the cache, logits of the last position,
    the greedy first token."""
    out = model(**inputs, use_cache=True, logits_to_keep=1)
    return out, out.logits[:, -1].argmax(-1)


class _Timer:
    """Wall time of a block: CUDA events on a GPU, ``perf_counter`` on CPU (seconds)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            self._a, self._b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._a.record()
        else:
            self._t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self._b.record()
            self._b.synchronize()
            self.seconds = self._a.elapsed_time(self._b) / 1000.0
        else:
            self.seconds = time.perf_counter() - self._t


# ---------------------------------------------------------------------------- instrumentation
class OverheadProbe:
    """Times the session's own hooks by wrapping them in hooks of ours (one registered in
    front of the session's, one after it) on the multimodal core and every decoder layer.
    Nothing global is patched; remove with `close`.

    ``totals`` (seconds, summed over the prefill): ``layout`` (the adapter reading the
    batch), ``relevance`` (the pre-hooks at merge layers: ξ from the layer's projections),
    ``stage`` (post-hooks at merge layers: graph, merge, new masks and positions),
    ``bookkeeping`` (the pre-hooks of other layers: masks, positions, cache layers).
    """

    def __init__(self, session, sync: Callable[[], None]):
        self.sync = sync
        self.totals = {"layout": 0.0, "relevance": 0.0, "stage": 0.0, "bookkeeping": 0.0}
        self._t: dict[str, float] = {}
        self._handles = []
        merge = {s.spec.layer for s in session.stages}
        mm = session.adapter.multimodal_module()
        self._pair_pre(mm, "layout")
        for i, layer in enumerate(session.layers):
            self._pair_pre(layer, "relevance" if i in merge else "bookkeeping")
            if i in merge:
                self._pair_post(layer, "stage")

    def _start(self, key):
        def hook(*_a, **_k):
            self.sync()
            self._t[key] = time.perf_counter()
        return hook

    def _stop(self, key):
        def hook(*_a, **_k):
            self.sync()
            self.totals[key] += time.perf_counter() - self._t.pop(key)
        return hook

    def _pair_pre(self, module, key):
        self._handles.append(module.register_forward_pre_hook(self._start(key), prepend=True))
        self._handles.append(module.register_forward_pre_hook(self._stop(key)))

    def _pair_post(self, module, key):
        self._handles.append(module.register_forward_hook(self._start(key), prepend=True))
        self._handles.append(module.register_forward_hook(self._stop(key)))

    def reset(self):
        self.totals = dict.fromkeys(self.totals, 0.0)

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()


class ReferenceScoring:
    """At each merge layer, what the authors' code does to get prompt relevance: the full
    attention matrix ``softmax(QK^T / sqrt d)`` of every head over all ``N x N`` token
    pairs, from the layer's own (post-RoPE) queries and keys, softmax over the query axis,
    vision rows summed over heads and text columns. Runs as an extra pre-hook after the
    session's, so it sees the layer's real (compressed) input; the result is discarded.

    ``seconds`` sums its time over a prefill; ``matrix_bytes`` records the largest
    ``[B, H, N, N]`` matrix it materialised.
    """

    def __init__(self, session, text_cols: tuple[int, int], sync: Callable[[], None]):
        from ..adapters.probes import probe_for_layer

        self.sync, self.pre, self.post = sync, text_cols[0], text_cols[1]
        self.seconds, self.matrix_bytes = 0.0, 0
        self._handles = []
        for s in session.stages:
            layer = session.layers[s.spec.layer]
            probe = probe_for_layer(layer)
            self._handles.append(layer.register_forward_pre_hook(self._hook(probe), with_kwargs=True))

    def _hook(self, probe):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            self.sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                scores = self.scores(probe, hidden, kwargs.get("position_embeddings"))
            self.sync()
            self.seconds += time.perf_counter() - t0
            del scores
        return hook

    def scores(self, probe, hidden, pos):
        b, n, _ = hidden.shape
        cos = sin = None
        if pos is not None and pos[0].dim() == 3 and pos[0].shape[-2] == n:
            cos, sin = pos[0].expand(b, -1, -1), pos[1].expand(b, -1, -1)
        x = probe.normed(hidden)
        q = probe.queries(x, cos, sin)  # [B, H, N, d]
        k = probe.keys(x, cos, sin)  # [B, Hkv, N, d]
        k = k.repeat_interleave(probe.heads // probe.kv_heads, dim=1)
        logits = torch.matmul(q, k.transpose(-1, -2)) * probe.head_dim**-0.5  # [B, H, N, N]
        self.matrix_bytes = max(self.matrix_bytes, logits.numel() * logits.element_size())
        attn = logits.softmax(dim=-2)  # over the query axis, every key column
        text = torch.cat([attn[..., : self.pre], attn[..., n - self.post:]], dim=-1)
        return text[:, :, self.pre: n - self.post].sum(dim=(1, 3))  # [B, vision]

    def reset(self):
        self.seconds = 0.0

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()


# ---------------------------------------------------------------------------- memory
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def _reset_hwm() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_peaks(spec: ModelSpec, cfg: BenchConfig, variants: Sequence[str]) -> dict[str, Any]:
    """Peak memory of one prefill per variant above the loaded model and inputs (bytes).

    On CPU call it in a process started with ``MALLOC_MMAP_THRESHOLD_`` set (see
    `_child_peaks`): the resident-set high-water mark then follows the live tensors.
    """
    from ..adapters import apply

    torch.manual_seed(0)
    device = torch.device(cfg.device)
    model, inputs, sizes = build_model(spec, cfg)
    sync = lambda: _sync(device)
    out: dict[str, Any] = {"method": None, "peak_bytes": {}, "reference_matrix_bytes": 0}

    def one(variant: str):
        if variant == UNCOMPRESSED:
            return first_token(model, inputs)
        name = "lightkv" if variant == EAGER_REF else variant
        pipe = scaled_pipeline(name, spec, sizes["layers"])
        with apply(pipe, model) as session:
            ref = ReferenceScoring(session, (PRE_TEXT, _post_cols(inputs)), sync) if variant == EAGER_REF else None
            try:
                res = first_token(model, inputs)
            finally:
                if ref is not None:
                    out["reference_matrix_bytes"] = ref.matrix_bytes
                    ref.close()
            return res

    with torch.no_grad():
        for variant in variants:  # warm-up: lazy initialisation, thread pools, caches
            r = one(variant)
            del r
        for variant in variants:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                r = one(variant)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated(device) - base
                out["method"] = "torch.cuda.max_memory_allocated"
            else:
                ok = _reset_hwm()
                base = _status_kb("VmRSS")
                r = one(variant)
                peak = _status_kb("VmHWM") - base if ok else _status_kb("VmRSS") - base
                out["method"] = "VmHWM (reset via /proc/self/clear_refs) - VmRSS before" if ok else "VmRSS delta"
            del r
            out["peak_bytes"][variant] = int(peak)
    return out


def _child_peaks(spec: ModelSpec, cfg: BenchConfig, variants: Sequence[str]) -> dict[str, Any]:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = "262144"  # fixed threshold: freed tensors go back to the OS at once
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    payload = json.dumps({"model": spec.name, "config": asdict(cfg), "variants": list(variants)})
    done = subprocess.run([sys.executable, "-m", "lightkv.bench.efficiency", "--memory-child", payload],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"memory measurement of {spec.name} failed: {tail[0]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _post_cols(inputs) -> int:
    """Text columns after the image (everything after the last vision token)."""
    from ..testing import IMAGE

    ids = inputs["input_ids"][0]
    pos = (ids == IMAGE).nonzero()
    return int(ids.shape[0] - 1 - pos[-1]) if pos.numel() else POST_TEXT


# ---------------------------------------------------------------------------- one model
def _kv_from_cache(cache, report) -> dict[str, Any]:
    """Total KV bytes from the cache tensors; the vision part as those tensors' bytes per
    entry times the vision (and structural) entries the session report counts per layer."""
    total = vision = 0
    lengths = []
    for i, layer in enumerate(cache.layers):
        nbytes = layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        length = int(layer.keys.shape[-2])
        total += nbytes
        lengths.append(length)
        if report is not None:
            lr = report.layers[i]
            vision += nbytes // max(1, length * layer.keys.shape[0]) * (lr.vision + lr.structural)
    return {"kv_bytes": total, "kv_bytes_vision": vision, "cache_lengths": lengths}


def _reference_shape_flops(spec: ModelSpec, name: str, report, n0: int) -> dict[str, float]:
    """FLOPs ratio and kept vision / total KV fractions on the full-size reference decoder,
    with the preset's own (unscaled) schedule and the per-stage token counts of this run."""
    from ..adapters.probes import LayerShape

    ref = spec.ref
    shape = LayerShape(hidden=ref["hidden"], heads=ref["heads"], kv_heads=ref["kv_heads"], head_dim=HEAD_DIM,
                       mlp_hidden=ref["intermediate"], mlp_matrices=3)
    plan = _preset(name, spec).scheduler.plan(ref["layers"])
    stages = report.stages
    if len(plan) != len(stages):  # a depth-dependent schedule: not comparable stage by stage
        return {}
    length, vision = n0, report.layers[0].vision + report.layers[0].structural
    v0, lengths, visions = vision, [], []
    at = {p.layer: s for p, s in zip(plan, stages)}
    for layer in range(ref["layers"]):
        lengths.append(length)
        visions.append(vision)
        if layer in at:
            s = at[layer]
            length, vision = s.width_out, vision - (s.vision_in - s.vision_out)
    flops = sum(shape.flops(l, (l + 1) / 2) for l in lengths)
    base = ref["layers"] * shape.flops(n0, (n0 + 1) / 2)
    return {
        "flops_ratio_reference_shape": flops / base,
        "kept_vision_fraction_reference_depth": sum(visions) / (v0 * ref["layers"]) if v0 else 1.0,
        "kv_ratio_reference_depth": sum(lengths) / (n0 * ref["layers"]),
        "reference_schedule": [p.layer for p in plan],
    }


def _ref_flops(spec: ModelSpec, n0: int) -> float:
    from ..adapters.probes import LayerShape

    ref = spec.ref
    shape = LayerShape(hidden=ref["hidden"], heads=ref["heads"], kv_heads=ref["kv_heads"], head_dim=HEAD_DIM,
                       mlp_hidden=ref["intermediate"], mlp_matrices=3)
    return ref["layers"] * shape.flops(n0, (n0 + 1) / 2)


def bench_model(spec: ModelSpec, cfg: BenchConfig, tick: Callable[[str], None]) -> dict[str, Any]:
    from ..adapters import apply
    from ..policies import average_kept_fraction

    torch.manual_seed(0)
    device = torch.device(cfg.device)
    sync = lambda: _sync(device)
    model, inputs, sizes = build_model(spec, cfg)
    ids = inputs["input_ids"]
    n0 = int(ids.shape[1])
    from ..testing import IMAGE

    n_vis = int((ids == IMAGE).sum())
    pipes = {p: scaled_pipeline(p, spec, sizes["layers"]) for p in cfg.presets}
    variants = [UNCOMPRESSED, *cfg.presets]
    times: dict[str, list[float]] = {v: [] for v in variants}
    overhead: dict[str, list[dict[str, float]]] = {p: [] for p in cfg.presets}
    last: dict[str, Any] = {}
    instrument_inline = device.type == "cpu"  # hooks cost microseconds on CPU; on CUDA they sync

    def prefill(variant: str, timed: bool):
        with torch.no_grad():
            if variant == UNCOMPRESSED:
                with _Timer(device) as t:
                    out, _tok = first_token(model, inputs)
                return t.seconds, out, None, None
            with apply(pipes[variant], model) as session:
                probe = OverheadProbe(session, sync) if instrument_inline else None
                try:
                    with _Timer(device) as t:
                        out, _tok = first_token(model, inputs)
                finally:
                    if probe is not None:
                        probe.close()
                return t.seconds, out, session, (dict(probe.totals) if probe else None)

    for i in range(cfg.warmup + cfg.repeats):
        for variant in variants:
            seconds, out, session, totals = prefill(variant, i >= cfg.warmup)
            if i >= cfg.warmup:
                times[variant].append(seconds)
                if totals is not None:
                    overhead[variant].append({**totals, "prefill": seconds})
            last[variant] = (out, session)
            tick(f"{spec.name}/{variant}")
    if not instrument_inline:  # separate instrumented runs (the hooks synchronise the GPU)
        for variant in cfg.presets:
            for _ in range(max(1, min(3, cfg.repeats))):
                with torch.no_grad(), apply(pipes[variant], model) as session:
                    probe = OverheadProbe(session, sync)
                    with _Timer(device) as t:
                        first_token(model, inputs)
                    probe.close()
                overhead[variant].append({**probe.totals, "prefill": t.seconds})

    entry: dict[str, Any] = {
        "title": spec.title,
        "image": spec.image_note if spec.family != "internvl" else f"{cfg.internvl_tiles} tile(s) of 16x16 "
        f"({cfg.internvl_tiles * 256} tokens)",
        "prompt_tokens": n0,
        "vision_tokens": n_vis,
        "reference_decoder": dict(spec.ref, head_dim=HEAD_DIM),
        "reduced_decoder": dict(sizes, head_dim=HEAD_DIM),
        "variants": {},
    }
    base_t = statistics.median(times[UNCOMPRESSED])
    base_flops = None
    for variant in variants:
        out, session = last[variant]
        report = session.report() if session is not None else None
        kv = _kv_from_cache(_cache(out), report)
        t = statistics.median(times[variant])
        rec: dict[str, Any] = {
            "ttft_ms_median": 1000 * t,
            "ttft_ms_min": 1000 * min(times[variant]),
            "ttft_ms_all": [1000 * x for x in times[variant]],
            **kv,
        }
        if report is None:
            rec["kv_bytes_vision"] = None  # filled from the first report below
        else:
            base_flops = report.prefill_flops_baseline
            sched = pipes[variant].scheduler.plan(sizes["layers"])
            rec.update(
                pipeline=report.pipeline,
                schedule_layers=[s.layer for s in sched],
                stages=[f"{s.vision_in}->{s.vision_out}" for s in report.stages],
                flops=report.prefill_flops,
                relevance_flops=report.relevance_flops,
                kept_vision_fraction=report.kept_vision_fraction,
                kept_vision_fraction_analytic=average_kept_fraction(sched, sizes["layers"]),
                kv_bytes_report=report.kv_bytes,
                kv_bytes_vision_baseline=report.kv_bytes_vision_baseline,
            )
            rec.update(_reference_shape_flops(spec, variant, report, n0))
            if overhead[variant]:
                parts = {k: statistics.median(o[k] for o in overhead[variant]) for k in overhead[variant][0]}
                prefill_s = parts.pop("prefill")
                total = sum(parts.values())
                rec["overhead_ms"] = {k: 1000 * v for k, v in parts.items()}
                rec["overhead_share"] = total / prefill_s
                rec["overhead_share_parts"] = {k: v / prefill_s for k, v in parts.items()}
                # the same at the full-size decoder, assuming this machine's FLOP rate: relevance
                # (projections) grows with width^2, the stage (hidden-state features) with width
                w = spec.ref["hidden"] / sizes["hidden"]
                est = parts["layout"] + parts["bookkeeping"] + parts["relevance"] * w * w + parts["stage"] * w
                flops_full = rec.get("flops_ratio_reference_shape")
                if flops_full is not None:
                    ref_prefill = base_t * _ref_flops(spec, n0) / report.prefill_flops_baseline * flops_full
                    rec["overhead_share_reference_estimate"] = est / ref_prefill
        entry["variants"][variant] = rec
    # the uncompressed variant's vision bytes and FLOPs (from the first compressed report)
    unc = entry["variants"][UNCOMPRESSED]
    for variant in cfg.presets:
        rec = entry["variants"][variant]
        unc["kv_bytes_vision"] = rec["kv_bytes_vision_baseline"]
        break
    if base_flops is not None:
        unc["flops"] = base_flops
    for variant in cfg.presets:
        rec = entry["variants"][variant]
        rec["ratios"] = {
            "flops": rec["flops"] / unc["flops"],
            "ttft": rec["ttft_ms_median"] / unc["ttft_ms_median"],
            "kv_bytes": rec["kv_bytes"] / unc["kv_bytes"],
            "kv_bytes_vision": rec["kv_bytes_vision"] / unc["kv_bytes_vision"] if unc["kv_bytes_vision"] else None,
        }
        rec["ttft_minus_flops_pp"] = 100 * (rec["ratios"]["ttft"] - rec["ratios"]["flops"])

    if cfg.eager_reference and "lightkv" in cfg.presets:
        ref_s, ours = [], []
        with torch.no_grad():
            for _ in range(cfg.eager_repeats):
                with apply(pipes["lightkv"], model) as session:
                    probe = OverheadProbe(session, sync)
                    ref = ReferenceScoring(session, (PRE_TEXT, _post_cols(inputs)), sync)
                    first_token(model, inputs)
                    probe.close()
                    ref.close()
                ref_s.append(ref.seconds)
                ours.append(probe.totals["relevance"])
                tick(f"{spec.name}/{EAGER_REF}")
        r, o = statistics.median(ref_s), statistics.median(ours)
        entry["eager_reference"] = {
            "reference_scoring_ms": 1000 * r,
            "lightkv_relevance_ms": 1000 * o,
            "time_ratio": r / o if o else None,
            "share_of_lightkv_prefill": r / (entry["variants"]["lightkv"]["ttft_ms_median"] / 1000),
            "matrix_bytes": ref.matrix_bytes,
            "matrix_shape": f"[1, {sizes['heads']}, N, N] at each merge layer; largest N={n0}",
            "matrix_bytes_reference_decoder": 4 * spec.ref["heads"] * n0 * n0 * (2 if cfg.dtype != "float32" else 1),
        }

    if cfg.memory:
        mem_variants = variants + ([EAGER_REF] if cfg.eager_reference and "lightkv" in cfg.presets else [])
        if device.type == "cuda":
            model = last = None
            gc.collect()
            peaks = measure_peaks(spec, cfg, mem_variants)
        else:
            peaks = _child_peaks(spec, cfg, mem_variants)
        tick(f"{spec.name}/memory")
        entry["memory_method"] = peaks["method"]
        for v, p in peaks["peak_bytes"].items():
            if v in entry["variants"]:
                entry["variants"][v]["peak_bytes"] = p
        up = peaks["peak_bytes"][UNCOMPRESSED]
        for v in cfg.presets:
            entry["variants"][v]["ratios"]["peak_memory"] = peaks["peak_bytes"][v] / up if up else None
        if EAGER_REF in peaks["peak_bytes"]:
            er = entry.setdefault("eager_reference", {})
            er["peak_bytes_lightkv"] = peaks["peak_bytes"]["lightkv"]
            er["peak_bytes_with_reference_scoring"] = peaks["peak_bytes"][EAGER_REF]
            er["peak_ratio_vs_uncompressed"] = peaks["peak_bytes"][EAGER_REF] / up if up else None
    model = last = None
    gc.collect()
    return entry


# ---------------------------------------------------------------------------- the run
def _steps(cfg: BenchConfig) -> int:
    per_model = (cfg.warmup + cfg.repeats) * (1 + len(cfg.presets))
    if cfg.eager_reference and "lightkv" in cfg.presets:
        per_model += cfg.eager_repeats
    per_model += 1 if cfg.memory else 0
    return per_model * len(cfg.models)


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled = total, 0, enabled
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc="efficiency", unit="run", file=sys.stderr)
            except ImportError:
                print("(tqdm is not installed: plain progress lines; pip install 'lightkv[bench]')", file=sys.stderr)

    def __call__(self, what: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what)
            self.bar.update(1)
        elif self.enabled and (self.n % 5 == 0 or self.n == self.total):
            print(f"[{self.n}/{self.total}] {what}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run(config: BenchConfig | None = None) -> dict[str, Any]:
    """Run the benchmark; returns a JSON-serialisable dict (see the module docstring)."""
    cfg = config or BenchConfig()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    from ..policies import ExplicitSchedule, average_kept_fraction

    t0 = time.perf_counter()
    progress = _Progress(_steps(cfg), cfg.progress)
    models = {}
    try:
        for name in cfg.models:
            models[name] = bench_model(MODELS[name], cfg, progress)
    finally:
        progress.close()
    ref_plan = ExplicitSchedule().plan(32)
    result = {
        "config": asdict(cfg),
        "machine": {
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "device": cfg.device,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "threads": torch.get_num_threads(),
        },
        "headline": "absolute times and ratios" if device.type == "cuda" else "ratios (CPU: absolute times are "
        "for reduced random-weight decoders on a shared machine)",
        "reductions": _reductions_note(cfg),
        "lightkv_reference_schedule": {
            "layers_of_32": [s.layer for s in ref_plan],
            "kept_vision_fraction_analytic": average_kept_fraction(ref_plan, 32),
        },
        "models": models,
        "seconds": time.perf_counter() - t0,
    }
    result["summary"] = summary_rows(result)
    result["targets"] = check_targets(result)
    return result


def _reductions_note(cfg: BenchConfig) -> str:
    parts = []
    for name in cfg.models:
        spec = MODELS[name]
        r, ref = spec.reduced(cfg.layers, cfg.heads), spec.ref
        parts.append(
            f"{spec.title}: {ref['layers']} -> {r['layers']} layers, width {ref['hidden']} -> {r['hidden']} "
            f"(heads {ref['heads']}/{ref['kv_heads']} -> {r['heads']}/{r['kv_heads']}, head_dim 128, "
            f"MLP {ref['intermediate']} -> {r['intermediate']})"
        )
    return ("; ".join(parts) + ". Vision-token counts are the real ones; vision towers are 1-layer stand-ins. "
            "Explicit schedules are scaled to the reduced depth by `scale_layers` (layers left uncompressed by "
            "each stage scaled by depth ratio).")


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat record per model and preset (the docs table)."""
    rows = []
    for name, m in result["models"].items():
        unc = m["variants"][UNCOMPRESSED]
        for variant, rec in m["variants"].items():
            if variant == UNCOMPRESSED:
                continue
            r = rec["ratios"]
            rows.append({
                "model": name,
                "preset": variant,
                "vision_tokens": m["vision_tokens"],
                "kept_vision": rec.get("kept_vision_fraction"),
                "kept_vision_ref_depth": rec.get("kept_vision_fraction_reference_depth"),
                "vision_kv_ratio": r.get("kv_bytes_vision"),
                "kv_ratio": r["kv_bytes"],
                "flops_ratio": r["flops"],
                "flops_ratio_ref_shape": rec.get("flops_ratio_reference_shape"),
                "ttft_ratio": r["ttft"],
                "ttft_ms": rec["ttft_ms_median"],
                "ttft_ms_uncompressed": unc["ttft_ms_median"],
                "peak_mem_ratio": r.get("peak_memory"),
                "overhead_share": rec.get("overhead_share"),
                "overhead_share_ref_est": rec.get("overhead_share_reference_estimate"),
            })
    return rows


def check_targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, checked on what was measured (None where not measured)."""
    models = result["models"]
    out: dict[str, Any] = {}
    vis = {n: m["variants"]["lightkv"].get("kept_vision_fraction_reference_depth")
           for n, m in models.items() if "lightkv" in m["variants"] and m["reference_decoder"]["layers"] == 32}
    out["lightkv_vision_kv_le_60pct_at_32_layers"] = (all(v is not None and v <= 0.60 for v in vis.values())
                                                     if vis else None)
    out["lightkv_vision_kv_at_32_layers"] = vis
    gaps = {f"{n}/{v}": rec["ttft_minus_flops_pp"] for n, m in models.items()
            for v, rec in m["variants"].items() if v != UNCOMPRESSED}
    out["ttft_within_5pp_of_flops"] = all(abs(g) <= 5 for g in gaps.values()) if gaps else None
    out["ttft_minus_flops_pp"] = gaps
    nxt = models.get("llava_next", {}).get("variants", {}).get("lightkv", {})
    out["overhead_le_3pct_llava_next"] = nxt["overhead_share"] <= 0.03 if "overhead_share" in nxt else None
    out["overhead_share_llava_next"] = nxt.get("overhead_share")
    est = nxt.get("overhead_share_reference_estimate")
    out["overhead_le_3pct_llava_next_reference_estimate"] = est <= 0.03 if est is not None else None
    out["overhead_share_llava_next_reference_estimate"] = est
    peaks = {n: m["variants"]["lightkv"].get("ratios", {}).get("peak_memory")
             for n, m in models.items() if "lightkv" in m["variants"]}
    peaks = {k: v for k, v in peaks.items() if v is not None}
    out["lightkv_peak_le_uncompressed"] = all(v <= 1.0 for v in peaks.values()) if peaks else None
    out["lightkv_peak_ratio"] = peaks
    spikes = {n: m["eager_reference"].get("peak_ratio_vs_uncompressed") for n, m in models.items()
              if "eager_reference" in m and m["eager_reference"].get("peak_ratio_vs_uncompressed") is not None}
    out["eager_reference_spike_above_uncompressed"] = any(v > 1.0 for v in spikes.values()) if spikes else None
    out["eager_reference_peak_ratio"] = spikes
    return out


# ---------------------------------------------------------------------------- outputs
def _f(v, fmt="{:.3f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def markdown_table(result: dict[str, Any]) -> str:
    """The summary as Markdown (ratios are compressed / uncompressed)."""
    dev = result["machine"]["device"]
    lines = [
        (f"Measured on {dev} ({result['machine']['device_name'] or 'unknown'}, {result['machine']['threads']} threads), "
        f"torch {result['machine']['torch']}. Ratios are preset / uncompressed; TTFT is the median of "
        f"{result['config']['repeats']} prefills after {result['config']['warmup']} warm-up(s)."),
        "",
        f"*Reduced decoders:* {result['reductions']}",
        "",
        ("| model | preset | vision tokens | vision KV (reduced) | vision KV (ref. depth) | KV total | FLOPs | "
        "FLOPs (ref. shape) | TTFT | TTFT ms (uncompr.) | peak mem | overhead | overhead (7B est.) |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["summary"]:
        lines.append(
            f"| {r['model']} | {r['preset']} | {r['vision_tokens']:,} | {_f(r['vision_kv_ratio'])} | "
            f"{_f(r['kept_vision_ref_depth'])} | {_f(r['kv_ratio'])} | {_f(r['flops_ratio'])} | "
            f"{_f(r['flops_ratio_ref_shape'])} | {_f(r['ttft_ratio'])} | "
            f"{_f(r['ttft_ms'], '{:.0f}')} ({_f(r['ttft_ms_uncompressed'], '{:.0f}')}) | "
            f"{_f(r['peak_mem_ratio'])} | {_f(r['overhead_share'], '{:.1%}')} | "
            f"{_f(r['overhead_share_ref_est'], '{:.1%}')} |"
        )
    eager = [(n, m["eager_reference"]) for n, m in result["models"].items() if "eager_reference" in m]
    if eager:
        lines += [
            "",
            "Reference-style relevance (full `H x N x N` attention at each merge layer) vs ours (`N x T`, sdpa):",
            "",
            ("| model | reference scoring ms | our relevance ms | time ratio | H x N x N bytes (reduced / 7B) | "
            "peak: lightkv | peak: + reference scoring | vs uncompressed |"),
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for n, e in eager:
            lines.append(
                f"| {n} | {_f(e.get('reference_scoring_ms'), '{:.1f}')} | {_f(e.get('lightkv_relevance_ms'), '{:.1f}')} | "
                f"{_f(e.get('time_ratio'), '{:.1f}x')} | {_mib(e.get('matrix_bytes'))} / "
                f"{_mib(e.get('matrix_bytes_reference_decoder'))} | {_mib(e.get('peak_bytes_lightkv'))} | "
                f"{_mib(e.get('peak_bytes_with_reference_scoring'))} | {_f(e.get('peak_ratio_vs_uncompressed'))} |"
            )
    ref = result["lightkv_reference_schedule"]
    lines += [
        "",
        (f"LightKV's reference schedule (layers {ref['layers_of_32']} of 32, 4/2/1 windows, half per stage) keeps "
        f"{ref['kept_vision_fraction_analytic']:.1%} of the vision KV analytically. *vision KV (ref. depth)* and "
        "*FLOPs (ref. shape)* apply each preset's unscaled schedule and this run's per-stage token counts to the "
        "full-size decoder. *overhead*: the compression's own hooks (layout, relevance, graph + merge, masks) as a "
        "share of the compressed prefill; *overhead (7B est.)* rescales it to the full-size decoder at this "
        "machine's FLOP rate (relevance x width ratio^2, stage x width ratio)."),
        "",
        "Targets: " + ", ".join(f"{k}: {v}" for k, v in result["targets"].items() if isinstance(v, bool) or v is None),
    ]
    return "\n".join(lines) + "\n"


def _mib(v) -> str:
    return "n/a" if v is None else f"{v / 2**20:,.1f} MiB"


def plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Bar charts (PNG); returns the files written, or [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping plots (pip install 'lightkv[bench]')", file=sys.stderr)
        return []
    rows = result["summary"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    by = {(r["model"], r["preset"]): r for r in rows}
    written = []
    metrics = [("ttft_ratio", "TTFT"), ("vision_kv_ratio", "vision KV bytes"), ("kv_ratio", "total KV bytes"),
               ("flops_ratio", "prefill FLOPs (analytic)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), sharey=True)
    width = 0.8 / max(1, len(presets))
    for ax, (key, title) in zip(axes, metrics):
        for j, p in enumerate(presets):
            vals = [by.get((m, p), {}).get(key) or 0 for m in models]
            ax.bar([i + j * width for i in range(len(models))], vals, width, label=p)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks([i + width * (len(presets) - 1) / 2 for i in range(len(models))], models, rotation=20)
        ax.set_title(title + " (preset / uncompressed)", fontsize=9)
    axes[0].set_ylabel("ratio")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "efficiency-ratios.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    parts = ["layout", "relevance", "stage", "bookkeeping"]
    labels, stacks = [], {k: [] for k in parts}
    for name, m in result["models"].items():
        for p, rec in m["variants"].items():
            if "overhead_share_parts" in rec:
                labels.append(f"{name}\n{p}")
                for k in parts:
                    stacks[k].append(100 * rec["overhead_share_parts"].get(k, 0.0))
    if labels:
        fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(labels)), 3.6))
        bottom = [0.0] * len(labels)
        for k in parts:
            ax.bar(range(len(labels)), stacks[k], bottom=bottom, label=k)
            bottom = [b + v for b, v in zip(bottom, stacks[k])]
        ax.axhline(3.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("% of compressed prefill")
        ax.set_title("compression overhead breakdown", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / "efficiency-overhead.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_outputs(result: dict[str, Any], out_dir: Path, with_plots: bool = True) -> list[Path]:
    """``efficiency.json``, ``efficiency.md`` and the PNGs in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "efficiency.json", out_dir / "efficiency.md"]
    files[0].write_text(json.dumps(_jsonable(result), indent=2) + "\n")
    files[1].write_text(markdown_table(result))
    if with_plots:
        files += plots(result, out_dir)
    return files


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v


def _memory_child(payload: str) -> int:
    data = json.loads(payload)
    cfg_dict = data["config"]
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg_dict.items()})
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    print(json.dumps(measure_peaks(MODELS[data["model"]], cfg, data["variants"])))
    return 0


if __name__ == "__main__":  # the memory child process
    if len(sys.argv) == 3 and sys.argv[1] == "--memory-child":
        raise SystemExit(_memory_child(sys.argv[2]))
    raise SystemExit("use `lightkv bench efficiency` or benchmarks/efficiency.py")
