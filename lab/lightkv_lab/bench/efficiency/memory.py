"""Prefill peak memory and time against prompt length: every preset beside the uncompressed
model (``lightkv bench memory``).

The shape is LLaVA-1.5's (one 24 x 24 image: 576 vision tokens) on a small random-weight
decoder (default 8 layers, 4 heads, width 64, `MemoryConfig`); the prompt grows by text after
the image (a long question or document: ``text_before`` tokens before the image, the rest
after), from about 1,000 to 16,000 tokens. Each (variant, prompt length) runs in its own
process, started with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 256 KiB so that freed
tensors go back to the system at once and the resident set follows the live tensors. In it:
the model is built, one warm-up prefill of a short prompt initialises every code path, the
kernel's high-water mark is reset (``/proc/self/clear_refs``) and one prefill of the long
prompt gives the peak resident set (``VmHWM``) beside the resident set before it. Then, in a
steady heap (`lightkv_lab.bench.allocator`: freed memory reused, as on a GPU; under the
peak's settings every large block would be fresh pages, which costs an allocation-heavy
preset several times its time), one untimed and ``repeats`` timed prefills give the wall and
CPU time (median). The kept vision-KV fraction is the session's report. Explicit schedules
are scaled to the depth (`lightkv_lab.bench.efficiency.shapes.scaled_pipeline`).

`width7b` adds the LightKV relevance (``query_softmax``) alone at a 7B decoder's heads (32 of
128) on the longest prompt, in its own process: the peak above its inputs and its time, beside
what the ``H x N x T`` scores it never holds would take.

The outputs (``prefill-memory.json``, ``prefill-memory.md``, ``prefill-memory.png``) are in
`lightkv_lab.bench.efficiency.memory_report`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightkv_lab.bench.efficiency.shapes import UNCOMPRESSED

__all__ = [
    "DEFAULT_LENGTHS",
    "UNCOMPRESSED",
    "MemoryConfig",
    "child_main",
    "measure_point",
    "quick_memory",
    "run_memory",
]

DEFAULT_LENGTHS = (1024, 2048, 4096, 5600, 9600, 16384)
"""Prompt tokens (vision and text together) of the default run."""
VISION_SIDE = 24  # LLaVA-1.5: a 24 x 24 grid, 576 vision tokens
WARMUP_TEXT = 64  # text tokens after the image in the warm-up prompt


@dataclass
class MemoryConfig:
    """What `run_memory` measures.

    Attributes:
        lengths: prompt lengths in tokens (576 of them vision tokens), ascending.
        presets: the presets beside the uncompressed model (empty: every preset).
        layers, heads, width: the decoder (head dim ``width / heads``; MLP in LLaVA-1.5's
            ratio, 11008 / 4096 of the width).
        text_before: text tokens before the image (the rest of the prompt follows it).
        repeats: timed prefills per point (median; the peak is over all of them).
        threads: torch CPU threads in each process (1 by default: CPU time and wall time then
            agree, and a shared machine's other work disturbs the ratios least).
        timeout: seconds one point may take before it is recorded as failed.
        memory_limit: bytes of data one point's process may map (``RLIMIT_DATA``): past it an
            allocation fails and the point is recorded as out of memory, instead of a preset
            whose memory is quadratic by design (``lightkv-paper-released``'s eager merge
            layers) taking a shared machine's memory. None: no limit.
        width7b: also measure the LightKV relevance alone at 7B heads on the longest prompt.
        progress: a progress bar.
    """

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    presets: tuple[str, ...] = ()
    layers: int = 8
    heads: int = 4
    width: int = 64
    text_before: int = 20
    repeats: int = 1
    threads: int | None = 1
    timeout: float = 1200.0
    memory_limit: int | None = 8 * 10**9
    width7b: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        from lightkv.presets import PRESETS

        self.lengths = tuple(sorted(int(n) for n in self.lengths))
        self.presets = tuple(self.presets) or tuple(sorted(PRESETS))
        shortest = VISION_SIDE**2 + self.text_before + WARMUP_TEXT + 1
        if not self.lengths or self.lengths[0] < shortest:
            raise ValueError(
                f"give prompt lengths of at least {shortest} tokens (576 vision, "
                f"{self.text_before} text before the image, {WARMUP_TEXT} after), got "
                f"{list(self.lengths)}"
            )
        bad = [p for p in self.presets if p not in PRESETS]
        if bad:
            raise ValueError(f"unknown preset(s) {bad}; see `lightkv presets`")
        if self.layers < 2 or self.heads < 1 or self.width % self.heads or self.width < self.heads:
            raise ValueError(
                f"need layers >= 2 and a width divisible by the heads, got layers {self.layers}, "
                f"heads {self.heads}, width {self.width}"
            )
        if self.repeats < 1 or self.timeout <= 0:
            raise ValueError("repeats must be >= 1 and timeout > 0")
        if self.memory_limit is not None and self.memory_limit < 2 * 10**9:
            raise ValueError(
                f"memory_limit must be at least 2 GB (torch itself maps about 1), got "
                f"{self.memory_limit / 1e9:.2f} GB"
            )

    @property
    def variants(self) -> tuple[str, ...]:
        return (UNCOMPRESSED, *self.presets)

    def decoder(self) -> dict[str, int]:
        inter = round(self.width * 11008 / 4096 / 16) * 16
        return {
            "layers": self.layers,
            "hidden": self.width,
            "heads": self.heads,
            "head_dim": self.width // self.heads,
            "intermediate": max(16, inter),
        }


def quick_memory(**over: Any) -> MemoryConfig:
    """A short run (a few minutes on 2 shared cores): 1,024 and 4,096 tokens, the uncompressed
    model beside lightkv-budget, fastv and divprune, no 7B-width point."""
    base: dict[str, Any] = {
        "lengths": (1024, 4096),
        "presets": ("lightkv-budget", "fastv", "divprune"),
        "width7b": False,
    }
    base.update(over)
    return MemoryConfig(**base)


# ---------------------------------------------------------------------------- one point
def _status_bytes(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _build(cfg: MemoryConfig, length: int):
    """The model and the long and warm-up prompts."""
    import torch

    from lightkv_lab.tiny import TINY_MODELS

    d = cfg.decoder()
    fam = TINY_MODELS["llava"]
    torch.manual_seed(0)
    model = fam.build(
        num_layers=d["layers"],
        hidden_size=d["hidden"],
        intermediate_size=d["intermediate"],
        num_heads=d["heads"],
        num_kv_heads=d["heads"],
        image_size=2 * VISION_SIDE,
        patch_size=2,
    )
    # RoPE tables are computed for any position; the config's limit is only declared
    model.config.text_config.max_position_embeddings = max(4096, 2 * length)
    after = length - VISION_SIDE**2 - cfg.text_before - 1  # row_llava adds one after the image

    def prompt(post: int):
        return fam.collate([fam.row(model, 1, pre=cfg.text_before, post=post, seed=0)])

    return model, prompt(after), prompt(WARMUP_TEXT)


def measure_point(cfg: MemoryConfig, variant: str, length: int) -> dict[str, Any]:
    """One (variant, prompt length) point in this process (`child_main` runs it in a fresh
    one): peak resident set during one prefill and the resident set before it, then wall and
    CPU seconds (median of ``repeats`` prefills after an untimed one, in a steady heap), the
    kept vision-KV fraction."""
    import torch

    from lightkv.adapters import apply
    from lightkv_lab.bench.allocator import host_allocator
    from lightkv_lab.bench.efficiency.shapes import MODELS, scaled_pipeline

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model, inputs, warm = _build(cfg, length)
    pipe = (
        None if variant == UNCOMPRESSED else scaled_pipeline(variant, MODELS["llava"], cfg.layers)
    )
    kept: list[float] = []

    def prefill(batch) -> None:
        if pipe is None:
            out = model(**batch, use_cache=True, logits_to_keep=1)
        else:
            with apply(pipe, model) as session:
                out = model(**batch, use_cache=True, logits_to_keep=1)
                kept.append(float(session.report().kept_vision_fraction))
        del out

    wall, cpu = [], []
    with torch.no_grad():
        prefill(warm)
        kept.clear()
        exact = _reset_peak()
        base = _status_bytes("VmRSS")
        prefill(inputs)  # the peak: every freed block goes back at once (MALLOC_MMAP_THRESHOLD_)
        # at least base: RSS counters are batched per CPU (VmHWM trailed VmRSS by 36 KiB on CI)
        peak = max(_status_bytes("VmHWM") if exact else _status_bytes("VmRSS"), base)
        # the times in a steady heap (freed memory reused, as PyTorch's caching allocator does
        # on a GPU): under the peak's settings every block of 256 KiB or more is fresh pages,
        # which made an allocation-heavy preset 4.6x slower than with glibc's defaults (measured)
        with host_allocator("steady") as heap:
            prefill(inputs)  # untimed: the heap grows to this prefill's size
            for _ in range(cfg.repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                prefill(inputs)
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
    return {
        "variant": variant,
        "length": int(inputs["input_ids"].shape[1]),
        "peak_bytes": int(peak),
        "base_bytes": int(base),
        "prefill_bytes": int(peak - base),
        "seconds": statistics.median(wall),
        "cpu_seconds": statistics.median(cpu),
        "kept_vision_fraction": kept[0] if kept else 1.0,
        "peak_method": "VmHWM after clear_refs" if exact else "VmRSS after (no clear_refs)",
        "timing_allocator": heap,
    }


def measure_width7b(length: int, threads: int | None) -> dict[str, Any]:
    """The LightKV relevance (``query_softmax``) alone at a 7B decoder's heads (32 of 128, in
    float32) on a ``length``-token prompt with the image after ``20`` text tokens: peak above
    its inputs, seconds, and the bytes of the ``H x N x T`` scores held at once before."""
    import torch

    from lightkv import ImageSegment, VisionLayout
    from lightkv.policies import QueryAxisSoftmax

    if threads:
        torch.set_num_threads(threads)
    heads, d = 32, 128
    layout = VisionLayout.from_segments(1, length, [ImageSegment(0, 20, (VISION_SIDE,) * 2)])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, length, d, generator=gen)
    k = torch.randn(1, heads, length, d, generator=gen)
    text = int(layout.text_mask.sum())
    short = VisionLayout.from_segments(1, 1024, [ImageSegment(0, 20, (VISION_SIDE,) * 2)])
    QueryAxisSoftmax().score(q[:, :, :1024], k[:, :, :1024], short)  # warm-up
    exact = _reset_peak()
    base = _status_bytes("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    QueryAxisSoftmax().score(q, k, layout)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = max(_status_bytes("VmHWM") if exact else _status_bytes("VmRSS"), base)
    return {
        "length": length,
        "text_tokens": text,
        "heads": heads,
        "head_dim": d,
        "peak_above_inputs_bytes": int(peak - base),
        "inputs_bytes": int(2 * q.numel() * 4),
        "seconds": wall,
        "cpu_seconds": cpu,
        "scores_bytes_at_once_before": int(heads * length * text * 4),
        # the fused CPU path's products (each pass also multiplies by its values), against one
        # LLaVA-1.5-7B decoder layer (projections, MLP, causal attention) on the same tokens
        "relevance_flops": 4.0 * heads * d * text * (length + VISION_SIDE**2),
        "layer_flops_7b": 2.0 * length * (4 * 4096**2 + 3 * 4096 * 11008) + 2.0 * length**2 * 4096,
    }


def child_main(payload: str) -> int:
    """A point's process: ``payload`` is the JSON job (``-``: read it from stdin)."""
    job = json.loads(sys.stdin.read() if payload == "-" else payload)
    if job["kind"] == "width7b":
        print(json.dumps(measure_width7b(job["length"], job["threads"])))
        return 0
    over = {k: tuple(v) if isinstance(v, list) else v for k, v in job["config"].items()}
    print(json.dumps(measure_point(MemoryConfig(**over), job["variant"], job["length"])))
    return 0


# ---------------------------------------------------------------------------- the run
def _limit(limit: int | None):
    """The child's ``preexec_fn``: cap its data mappings at ``limit`` bytes."""
    if limit is None:
        return None

    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    return cap


def _in_child(job: dict[str, Any], timeout: float, limit: int | None = None) -> dict[str, Any]:
    """Run one job in a fresh process (its data capped at ``limit`` bytes); a failure becomes
    ``{"error": its last line}``."""
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(256 * 1024)  # freed tensors go back to the system
    lab = Path(__file__).resolve().parents[3]  # the folder above lightkv_lab
    roots = [str(lab)] + ([str(lab.parent)] if (lab.parent / "lightkv").is_dir() else [])
    env["PYTHONPATH"] = os.pathsep.join(roots + [env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "lightkv_lab.bench.efficiency.memory", "--child", "-"]
    try:
        done = subprocess.run(
            cmd,
            input=json.dumps(job),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            preexec_fn=_limit(limit),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"took longer than {timeout:g} s (--timeout)"}
    if done.returncode != 0:
        lines = (done.stderr or "").strip().splitlines() or [f"exit status {done.returncode}"]
        last = lines[-1]
        if limit is not None and ("can't allocate memory" in last or "MemoryError" in last):
            last = f"out of memory: needs more than the {limit / 1e9:g} GB limit (--memory-limit)"
        return {"error": last[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_memory(cfg: MemoryConfig | None = None) -> dict[str, Any]:
    """Every point, each in its own process; a JSON-serialisable dict (the module docstring)."""
    import torch

    from lightkv_lab.bench.efficiency.memory_report import check_targets
    from lightkv_lab.bench.progress import Progress

    cfg = cfg or MemoryConfig()
    t0 = time.perf_counter()
    jobs = [(n, v) for n in cfg.lengths for v in cfg.variants]  # variants interleaved per length
    progress = Progress(len(jobs) + int(cfg.width7b), "memory", quiet=not cfg.progress)
    points = []
    try:
        for length, variant in jobs:
            job = {"kind": "point", "config": asdict(cfg), "variant": variant, "length": length}
            got = _in_child(job, cfg.timeout, cfg.memory_limit)
            points.append({"variant": variant, "length": length, **got})
            progress(f"{variant} @ {length}")
        width7b = None
        if cfg.width7b:
            job = {"kind": "width7b", "length": cfg.lengths[-1], "threads": cfg.threads}
            width7b = _in_child(job, cfg.timeout, cfg.memory_limit)
            progress(f"query_softmax at 7B heads @ {cfg.lengths[-1]}")
    finally:
        progress.close()
    result: dict[str, Any] = {
        "config": asdict(cfg),
        "decoder": cfg.decoder(),
        "vision_tokens": VISION_SIDE**2,
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "threads": cfg.threads or torch.get_num_threads(),
        },
        "points": points,
        "width7b": width7b,
        "seconds": time.perf_counter() - t0,
    }
    result["targets"] = check_targets(result)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        raise SystemExit(child_main(sys.argv[2]))
    raise SystemExit("use `lightkv bench memory`")
