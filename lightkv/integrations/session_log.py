"""What lightkv's lmms-eval model logs: per-sample session reports, their totals, and where
each data-parallel process runs. Torch and lightkv only (no lmms-eval), so it is tested in
the normal suite.

```python
from lightkv.integrations.session_log import PrefillTimer, row_reports
with session, PrefillTimer(model) as timer:
    model.generate(**inputs)
rows = row_reports(session, timer.seconds)    # one dict per batch row
```

A `lightkv.adapters.report.SessionReport` sums over the batch; `row_reports` splits the same
figures per row (the rows add up to the report: tested), so every lmms-eval sample carries
its own kept vision fraction and vision KV bytes. ``prefill_s`` is the wall time of the
batch's first forward (vision encoder + prefill), shared by the rows of one batch.

Data parallel (``accelerate launch --num_processes N -m lmms_eval``): every process holds one
model copy and answers one shard of the documents. lmms-eval itself shards: its evaluator
reads ``RANK`` / ``WORLD_SIZE`` from the environment (accelerate sets them) and builds, on
rank ``r``, the requests of documents ``r, r + N, r + 2N, ...`` (`shard`); it also sets the
model's ``_rank`` / ``_world_size``. The model only has to sit on its own device
(`placement`: ``cuda:LOCAL_RANK``, accelerate's ``process_index`` as the rank) and to combine
its totals with the other ranks' (`gather_totals`) before logging the aggregate.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

__all__ = [
    "Placement",
    "PrefillTimer",
    "ReportTotals",
    "gather_totals",
    "placement",
    "row_reports",
    "shard",
    "single_process_launch",
    "uncompressed_rows",
    "warn_lmms_eval_user",
]


def row_reports(session, prefill_s: float | None) -> list[dict[str, Any]]:
    """Per batch row, the last prefill of ``session``: kept vision fraction (averaged over
    layers; None without vision tokens), vision tokens of the prompt, vision KV bytes with
    and without compression, prompt tokens, the batch's ``prefill_s`` and size."""
    trace = session.last_prefill
    if trace is None or not trace.layers:
        raise RuntimeError("no prefill has run in this session")
    elem = torch.empty((), dtype=trace.kv_dtype or torch.float32).element_size()
    first = trace.layers[0]
    v0 = first.vision.detach().double().cpu()
    vis0 = v0 + first.structural.detach().double().cpu()
    kept = torch.zeros_like(v0)
    kv = torch.zeros_like(v0)
    kv0 = torch.zeros_like(v0)
    for stat in trace.layers:
        shape = session.layer_shapes[stat.layer]
        per_token = 2 * shape.kv_heads * shape.head_dim * elem
        vis = stat.vision.detach().double().cpu()
        kv += per_token * (vis + stat.structural.detach().double().cpu())
        kv0 += per_token * vis0
        kept += vis / v0.clamp_min(1)
    kept /= len(trace.layers)
    name = getattr(session.pipeline, "name", "custom")
    prompt = trace.input_valid.detach().cpu()
    prompt = prompt.sum(-1) if prompt.dim() > 1 else prompt
    return [
        {
            "pipeline": name,
            "kept_vision_fraction": float(kept[b]) if v0[b] > 0 else None,
            "vision_tokens": int(v0[b]),
            "kv_bytes_vision": int(kv[b]),
            "kv_bytes_vision_baseline": int(kv0[b]),
            "prompt_tokens": int(prompt[b]),
            "prefill_s": prefill_s,
            "batch_size": trace.batch_size,
        }
        for b in range(trace.batch_size)
    ]


def uncompressed_rows(
    has_vision: list[bool], prompt_tokens: list[int], prefill_s: float | None
) -> list[dict]:
    """The rows of a batch generated without any lightkv session (``pipeline`` None): every
    vision token is kept; KV bytes are not measured (no hooks ran)."""
    return [
        {
            "pipeline": None,
            "kept_vision_fraction": 1.0 if v else None,
            "vision_tokens": None,
            "kv_bytes_vision": None,
            "kv_bytes_vision_baseline": None,
            "prompt_tokens": n,
            "prefill_s": prefill_s,
            "batch_size": len(has_vision),
        }
        for v, n in zip(has_vision, prompt_tokens)
    ]


class PrefillTimer:
    """Wall time of the first forward of ``model`` inside the ``with`` block (in ``generate``
    that is the vision encoder plus the prefill); CUDA is synchronised around it."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.seconds: float | None = None
        self._t0: float | None = None
        self._handles: list[Any] = []

    def _sync(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    def _pre(self, module, args) -> None:
        if self._t0 is None:
            self._sync()
            self._t0 = time.perf_counter()

    def _post(self, module, args, output) -> None:
        if self.seconds is None and self._t0 is not None:
            self._sync()
            self.seconds = time.perf_counter() - self._t0

    def __enter__(self) -> PrefillTimer:
        self.seconds, self._t0 = None, None
        self._handles = [
            self.model.register_forward_pre_hook(self._pre),
            self.model.register_forward_hook(self._post),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@dataclass
class ReportTotals:
    """Sums over logged rows (one process's, or all of them after `gather_totals`)."""

    samples: int = 0
    kept_sum: float = 0.0
    kept_count: int = 0
    kv_bytes_vision: float = 0.0
    kv_bytes_vision_baseline: float = 0.0
    kv_count: int = 0
    prefill_s: float = 0.0
    """Summed over batches (each row adds its batch's time divided by the batch size)."""
    generate_s: float = 0.0
    """Likewise, the batches' whole ``generate`` calls."""
    output_tokens: int = 0

    def add(self, row: dict[str, Any]) -> None:
        self.samples += 1
        if row.get("kept_vision_fraction") is not None:
            self.kept_sum += row["kept_vision_fraction"]
            self.kept_count += 1
        if row.get("kv_bytes_vision") is not None:
            self.kv_bytes_vision += row["kv_bytes_vision"]
            self.kv_bytes_vision_baseline += row["kv_bytes_vision_baseline"]
            self.kv_count += 1
        per_row = 1 / max(1, row.get("batch_size") or 1)
        if row.get("prefill_s") is not None:
            self.prefill_s += row["prefill_s"] * per_row
        if row.get("generate_s") is not None:
            self.generate_s += row["generate_s"] * per_row
        self.output_tokens += int(row.get("output_tokens") or 0)

    @classmethod
    def merge(cls, parts: list[ReportTotals]) -> ReportTotals:
        out = cls()
        for p in parts:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(p, f.name))
        return out

    def metrics(self, prefix: str = "lightkv_") -> dict[str, float]:
        """Means per sample: kept vision fraction (of samples with vision tokens), vision KV
        bytes with and without compression, prefill seconds, and the sample count."""
        out: dict[str, float] = {f"{prefix}samples": float(self.samples)}
        if self.kept_count:
            out[f"{prefix}kept_vision_fraction"] = self.kept_sum / self.kept_count
        if self.kv_count:
            out[f"{prefix}kv_bytes_vision"] = self.kv_bytes_vision / self.kv_count
            out[f"{prefix}kv_bytes_vision_baseline"] = self.kv_bytes_vision_baseline / self.kv_count
        if self.samples:
            out[f"{prefix}prefill_s"] = self.prefill_s / self.samples
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gather_totals(totals: dict[str, ReportTotals], world_size: int) -> dict[str, ReportTotals]:
    """The totals of every rank merged (per key, e.g. per task). With one process, or when
    no process group is up, the local totals. A collective: every rank must call it."""
    parts = [totals]
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered: list[Any] = [None] * world_size  # every rank's totals as plain dicts
        torch.distributed.all_gather_object(gathered, {k: v.to_dict() for k, v in totals.items()})
        parts = [{k: ReportTotals(**v) for k, v in p.items()} for p in gathered]
    keys = list(dict.fromkeys(k for p in parts for k in p))
    return {k: ReportTotals.merge([p[k] for p in parts if k in p]) for k in keys}


def shard(num_docs: int, rank: int, world_size: int) -> list[int]:
    """The documents lmms-eval gives rank ``rank`` of ``world_size`` (its
    ``utils.create_iterator``: every ``world_size``-th document from ``rank``)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    return list(range(rank, num_docs, world_size))


@dataclass(frozen=True)
class Placement:
    """Where one evaluation process runs its model copy."""

    rank: int
    """Global rank (accelerate's ``process_index``, lmms-eval's ``RANK``)."""
    world_size: int
    device: torch.device
    device_map: Any
    """What ``from_pretrained`` gets (None: load, then move to ``device``)."""


def single_process_launch(env: Mapping[str, str], num_processes: int) -> str | None:
    """A warning when ``accelerate launch`` was asked for several processes and started one.

    On a machine without GPUs (or with ``--cpu``) accelerate's launcher runs the script once,
    in this process, although ``--num_processes N`` was given: it sets ``MASTER_ADDR`` (only
    for ``N > 1``) and its own ``ACCELERATE_*`` variables but no ``WORLD_SIZE``, which
    ``torch.distributed.run`` (accelerate's multi-process launcher) always sets. Read from
    accelerate 1.x's ``prepare_simple_launcher_cmd_env`` (``accelerate/utils/launch.py``).
    """
    launched = "ACCELERATE_MIXED_PRECISION" in env and "MASTER_ADDR" in env
    if num_processes == 1 and launched and "WORLD_SIZE" not in env:
        return (
            "accelerate launch started one process although several were asked for (on CPU it "
            "does not start more); every document runs here: for several CPU processes use "
            "`python -m torch.distributed.run --nproc_per_node N -m lmms_eval ...`"
        )
    return None


def warn_lmms_eval_user(message: str, stream=None) -> None:
    """Print ``lightkv: warning: message`` on stderr (or ``stream``), flushed.

    Not `warnings.warn`: lmms-eval's entry point ignores every Python warning, so a warning
    about how the run was launched never reached the user. Not `logging` either (lmms-eval
    logs through loguru and may configure the standard loggers). A plain write to stderr is
    what no filter of lmms-eval silences."""
    print(f"lightkv: warning: {message}", file=stream or sys.stderr, flush=True)


def placement(
    *,
    process_index: int,
    local_process_index: int,
    num_processes: int,
    accelerator_device: torch.device | str | None = None,
    device: str | None = None,
    device_map: Any = None,
) -> Placement:
    """The process's placement. Data parallel (``num_processes > 1``): the accelerator's
    device (``cuda:LOCAL_RANK``, or the CPU under ``accelerate launch --cpu``), one whole
    model copy on it unless ``device_map`` says otherwise. One process: ``device`` (default
    CUDA when available), or ``device_map`` as given (e.g. ``auto`` to shard one big model)."""
    if num_processes > 1:
        dev = (
            torch.device(accelerator_device)
            if accelerator_device is not None
            else torch.device(f"cuda:{local_process_index}")
        )
        return Placement(
            process_index, num_processes, dev, device_map if device_map else {"": str(dev)}
        )
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return Placement(0, 1, dev, device_map or None)
