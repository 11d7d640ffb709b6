"""Timed greedy generation with and without a pipeline (`run`): time to first token and
generate time measured in the same calls."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .errors import GenerateError, _first_line
from .results import GenerateResult, Loaded, Run

__all__ = ["MAX_REPEATS", "run"]

MAX_REPEATS = 20
"""The most timed generate calls per variant (each is a whole generation)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _FirstTokenClock:
    """A generate streamer that notes when the first new token reaches the host.

    ``generate`` hands the prompt to ``put`` first, then each step's tokens (after moving
    them to the CPU, which waits for the device), so the second ``put`` is the first token.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _generate(
    loaded: Loaded, inputs: dict[str, Any], max_new_tokens: int
) -> tuple[torch.Tensor, float, float]:
    """One greedy generate call: ``(output ids, seconds to the first new token,
    seconds in all)``."""
    model = loaded.model
    pad = getattr(loaded.processor, "tokenizer", None)
    pad_id = getattr(pad, "pad_token_id", None) if pad is not None else None
    extra = {"pad_token_id": pad_id} if pad_id is not None else {}
    clock = _FirstTokenClock()
    _sync(loaded.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            streamer=clock,
            **extra,
        )
    _sync(loaded.device)
    end = time.perf_counter()
    return out, (clock.first or end) - t0, end - t0


def _one(loaded: Loaded, inputs: dict[str, Any], max_new_tokens: int, repeats: int = 1) -> Run:
    """``repeats`` greedy generations; the answer of the first (greedy: all are equal) and
    the medians of their times, both timed in each call."""
    calls = [_generate(loaded, inputs, max_new_tokens) for _ in range(repeats)]
    out = calls[0][0]
    new = out[0, inputs["input_ids"].shape[1] :]
    answer = loaded.processor.decode(new, skip_special_tokens=True).strip()
    return Run(
        answer=answer,
        new_tokens=int(new.shape[0]),
        ttft_s=statistics.median(c[1] for c in calls),
        total_s=statistics.median(c[2] for c in calls),
        repeats=repeats,
    )


def run(
    loaded: Loaded,
    inputs: dict[str, Any],
    pipeline,
    *,
    compare: bool = False,
    max_new_tokens: int = 32,
    warmup: bool = True,
    repeats: int = 3,
) -> GenerateResult:
    """Greedy generation with ``pipeline`` compressing the prefill (and without, with
    ``compare``); times are medians over ``repeats`` generate calls per variant.

    Raises:
        GenerateError: the pipeline does not fit the model (e.g. a schedule deeper than
            the decoder), or the model family cannot be compressed.
    """
    from ..adapters import apply
    from ..config import ConfigError

    try:  # fail before generating anything
        session = apply(pipeline, loaded.model)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise GenerateError(f"cannot compress this model: {_first_line(e)}") from None
    if not 1 <= int(repeats) <= MAX_REPEATS:
        raise GenerateError(
            f"repeats must be in [1, {MAX_REPEATS}] (each is a whole generation), got {repeats!r}"
        )
    if warmup:  # first calls pay one-off costs (allocations, kernels); keep them out of the timings
        _generate(loaded, inputs, 1)
    baseline = _one(loaded, inputs, max_new_tokens, repeats) if compare else None
    with session:
        compressed = _one(loaded, inputs, max_new_tokens, repeats)
    report = session.report()
    return GenerateResult(
        loaded=loaded,
        pipeline=getattr(pipeline, "name", "custom"),
        prompt_tokens=int(inputs["input_ids"].shape[1]),
        compressed=compressed,
        report=report,
        baseline=baseline,
    )
