"""What the efficiency benchmark measures inside a prefill, and how.

Timers (CUDA events on a GPU), `OverheadProbe` (the compression's own hooks, timed),
`ReferenceScoring` (the authors' full ``H x N x N`` relevance, timed and sized), and peak
memory: `measure_peaks`, run on CPU in a child process (`measure_peaks_in_child`) whose
allocator returns freed tensors to the system at once. KV bytes and FLOPs accounting are in
`lightkv_lab.bench.efficiency.accounting`.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lightkv_lab.bench.efficiency.shapes import (
    EAGER_REF,
    MODELS,
    PRE_TEXT,
    PROJECTED,
    UNCOMPRESSED,
    BenchConfig,
    ModelSpec,
    build_model,
    scaled_pipeline,
    text_after_image,
)

__all__ = [
    "OverheadProbe",
    "ReferenceScoring",
    "Timer",
    "first_token",
    "measure_peaks",
    "measure_peaks_in_child",
]


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_of(out):
    c = out.get("cache") if hasattr(out, "get") else None
    return c if c is not None else out.past_key_values


def first_token(model, inputs):
    """One prefill as ``generate`` does it: fill the cache, logits of the last position,
    the greedy first token."""
    out = model(**inputs, use_cache=True, logits_to_keep=1)
    return out, out.logits[:, -1].argmax(-1)


class Timer:
    """Wall time of a block: CUDA events on a GPU, ``perf_counter`` on CPU (seconds)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            self._a, self._b = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
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
    batch), ``relevance`` (the pre-hooks at merge layers and at layers whose cache a mode
    rewrites, and the projection taps' hooks inside them: ξ or the cache modes' importance
    from the layer's projections), ``stage`` (post-hooks at those layers: graph, merge, new
    masks and positions; a cache mode's merge or eviction), ``bookkeeping`` (the pre-hooks
    of other layers: masks, positions, cache layers).
    """

    def __init__(self, session, sync: Callable[[], None]):
        self.sync = sync
        self.totals = {"layout": 0.0, "relevance": 0.0, "stage": 0.0, "bookkeeping": 0.0}
        self._t: dict[str, float] = {}
        self._handles = []
        # the cache modes (ElasticCache, H2O) score in their taps and rewrite after their layers
        scored = {s.spec.layer for s in session.stages}.union(
            *(m.cache_layers for m in session.modes)
        )
        mm = session.adapter.multimodal_module()
        self._pair_pre(mm, "layout")
        for i, layer in enumerate(session.layers):
            self._pair_pre(layer, "relevance" if i in scored else "bookkeeping")
            if i in scored:
                self._pair_post(layer, "stage")
        projections = {
            id(module): module
            for mode in session.modes
            for tap in getattr(mode, "taps", {}).values()
            for module in tap.probe.projections().values()
        }
        for module in projections.values():  # computed inside the attention, as its projections run
            self._pair_post(module, "relevance")

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
        from lightkv.adapters.probes import probe_for_layer

        self.sync, self.pre, self.post = sync, text_cols[0], text_cols[1]
        self.seconds, self.matrix_bytes = 0.0, 0
        self._handles = []
        for s in session.stages:
            layer = session.layers[s.spec.layer]
            probe = probe_for_layer(layer)
            self._handles.append(
                layer.register_forward_pre_hook(self._hook(probe), with_kwargs=True)
            )

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
        text = torch.cat([attn[..., : self.pre], attn[..., n - self.post :]], dim=-1)
        return text[:, :, self.pre : n - self.post].sum(dim=(1, 3))  # [B, vision]

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
    `measure_peaks_in_child`): the resident-set high-water mark then follows the live tensors.
    """
    from lightkv.adapters import apply

    torch.manual_seed(0)
    device = torch.device(cfg.device)
    model, inputs, sizes = build_model(spec, cfg)
    sync = lambda: sync_device(device)
    out: dict[str, Any] = {"method": None, "peak_bytes": {}, "reference_matrix_bytes": 0}

    def one(variant: str):
        if variant == UNCOMPRESSED:
            return first_token(model, inputs)
        name = "lightkv" if variant in (EAGER_REF, PROJECTED) else variant
        pipe = scaled_pipeline(name, spec, sizes["layers"])
        with apply(pipe, model, reuse_projections=variant != PROJECTED) as session:
            ref = (
                ReferenceScoring(session, (PRE_TEXT, text_after_image(inputs)), sync)
                if variant == EAGER_REF
                else None
            )
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
                # at least zero: the kernel's batched RSS counters can put the high-water
                # mark a few pages below the VmRSS read before the call
                peak = max((_status_kb("VmHWM") if ok else _status_kb("VmRSS")) - base, 0)
                out["method"] = (
                    "VmHWM (reset via /proc/self/clear_refs) - VmRSS before"
                    if ok
                    else "VmRSS delta"
                )
            del r
            out["peak_bytes"][variant] = int(peak)
    return out


def measure_peaks_in_child(
    spec: ModelSpec, cfg: BenchConfig, variants: Sequence[str]
) -> dict[str, Any]:
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = (
        "262144"  # fixed threshold: freed tensors go back to the OS at once
    )
    lab = (
        Path(__file__).resolve().parents[3]
    )  # the folder above lightkv_lab, and in a checkout the library's
    roots = [str(lab)] + (
        [str(lab.parent)] if (lab.parent / "lightkv" / "__init__.py").is_file() else []
    )
    env["PYTHONPATH"] = os.pathsep.join(roots + [env.get("PYTHONPATH", "")])
    payload = json.dumps({"model": spec.name, "config": asdict(cfg), "variants": list(variants)})
    # the configuration goes through stdin, not the command line: its lists (presets, kept
    # fractions) can be longer than the system's argument limit
    done = subprocess.run(
        [sys.executable, "-m", "lightkv_lab.bench.efficiency", "--memory-child", "-"],
        input=payload,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"memory measurement of {spec.name} failed: {tail[0]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory_child_main(payload: str) -> int:
    """The memory child's entry: ``payload`` is the JSON job, or ``-`` to read it from stdin."""
    data = json.loads(sys.stdin.read() if payload == "-" else payload)
    cfg_dict = data["config"]
    cfg = BenchConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg_dict.items()})
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    print(json.dumps(measure_peaks(MODELS[data["model"]], cfg, data["variants"])))
    return 0
