"""What generation works with and returns: the `Loaded` model, each variant's `Run` and
the `GenerateResult` with its JSON summary and human-readable format."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["GenerateResult", "Loaded", "Run"]


@dataclass
class Loaded:
    """A model with its processor."""

    model: Any
    processor: Any
    family: str
    source: str
    device: torch.device


@dataclass
class Run:
    """Greedy generation: the answer and its times (seconds), each the median over
    ``repeats`` generate calls that timed both (the first token and the whole call)."""

    answer: str
    new_tokens: int
    ttft_s: float
    total_s: float
    repeats: int = 1


@dataclass
class GenerateResult:
    """What ``run`` returns: the compressed run, its report and optionally the baseline."""

    loaded: Loaded
    pipeline: str
    prompt_tokens: int
    compressed: Run
    report: Any
    baseline: Run | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary."""
        rep = self.report
        return {
            "model": self.loaded.source,
            "family": self.loaded.family,
            "pipeline": self.pipeline,
            "prompt_tokens": self.prompt_tokens,
            "compressed": asdict(self.compressed),
            "baseline": asdict(self.baseline) if self.baseline is not None else None,
            "kept_vision_fraction": rep.kept_vision_fraction,
            "target_kept_fraction": rep.target_kept_fraction,
            "missed_target": rep.missed_target,
            "kv_bytes_vision": rep.kv_bytes_vision,
            "kv_bytes_vision_baseline": rep.kv_bytes_vision_baseline,
            "kv_bytes": rep.kv_bytes,
            "kv_bytes_baseline": rep.kv_bytes_baseline,
            "stages": [asdict(s) for s in rep.stages],
            "notes": list(self.notes),
        }

    def format(self) -> str:
        """A short human-readable summary (answers, then the report)."""
        rep = self.report
        m = self.loaded
        lines = [
            f"model: {m.source} ({m.family}, {type(m.model).__name__}, "
            f"{_dtype_name(m.model.dtype)}, {m.device})",
            f"pipeline: {self.pipeline}; prompt: {self.prompt_tokens} tokens",
        ]
        lines += [
            f"note: {n}" for n in self.notes
        ]  # before the answers: e.g. that they mean nothing here
        lines += [f"answer (lightkv): {self.compressed.answer!r}"]
        if self.baseline is not None:
            lines.append(f"answer (baseline): {self.baseline.answer!r}")
            same = "yes" if self.baseline.answer == self.compressed.answer else "no"
            lines.append(f"answers identical: {same}")
        kept = "n/a" if rep.kept_vision_fraction is None else f"{rep.kept_vision_fraction:.3f}"
        lines += [
            "report:",
            f"  kept vision fraction (avg over layers): {kept}"
            + (
                ""
                if rep.target_kept_fraction is None
                else f" (target {rep.target_kept_fraction:.3f})"
            ),
            (
                f"  vision KV bytes: {rep.kv_bytes_vision:,} with lightkv / "
                f"{rep.kv_bytes_vision_baseline:,} without "
                f"({_ratio(rep.kv_bytes_vision, rep.kv_bytes_vision_baseline)})"
            ),
            (
                f"  total KV bytes: {rep.kv_bytes:,} with lightkv / {rep.kv_bytes_baseline:,} "
                f"without ({_ratio(rep.kv_bytes, rep.kv_bytes_baseline)})"
            ),
        ]
        for s in rep.stages:
            lines.append(
                f"  stage after layer {s.layer}: vision tokens {s.vision_in} -> {s.vision_out}"
            )
        c, b = self.compressed, self.baseline
        lines.append(
            f"  time to first token: {_ms(c.ttft_s)} with lightkv"
            + (f" / {_ms(b.ttft_s)} without" if b else "")
        )
        lines.append(
            f"  generate time: {_ms(c.total_s)} with lightkv ({c.new_tokens} new tokens)"
            + (f" / {_ms(b.total_s)} without ({b.new_tokens} new tokens)" if b else "")
        )
        lines.append(
            f"  (times: median of {c.repeats} generate call(s) each; the first token and the whole "
            "call are timed in the same calls)"
        )
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"
