"""The pre-LLM mode: one stage on the embeddings, before decoder layer 0.

Every decoder layer then sees (and caches) the shorter sequence, which is what a serving
engine can do without per-layer sequence lengths: vLLM prunes multimodal tokens before the
language model in the same way (see the "Serving" design page). Survivors keep their
original positions; with a window-local pruner the kept count depends only on the image
shapes and the ratio, so it can be known before the prompt is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import removed_names
from .core import Scheduler, StageSpec, check_fraction, check_windows

__all__ = ["PreLLMSchedule"]


@Scheduler.register("pre_llm")
@removed_names(ratio="removal_ratio")
@dataclass
class PreLLMSchedule(Scheduler):
    """One stage before the first decoder layer.

    Attributes:
        removal_ratio: removal ratio in ``[0, 1)`` (with a parity split at most 0.5 really leaves).
        windows_per_side: windows per image side, or
        window_size: window ``(rows, cols)`` in tokens (replaces ``windows_per_side``).
    """

    removal_ratio: float = 0.5
    windows_per_side: int | None = 4
    window_size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_fraction(self.removal_ratio, "removal_ratio", False, True, "removal ratio")
        if self.window_size is not None:
            self.windows_per_side = None
            self.window_size = tuple(self.window_size)  # type: ignore[assignment]
            check_windows(None, [self.window_size])
        else:
            check_windows([self.windows_per_side], None)

    def max_stages(self) -> int:
        return 1

    def plan(self, num_layers):
        self._check_depth(num_layers)
        spec = StageSpec(
            0, float(self.removal_ratio), self.windows_per_side, self.window_size, mode="pre_llm"
        )
        return self._validate([spec], num_layers)
