"""The pre-LLM mode: one stage on the embeddings, before decoder layer 0.

Every decoder layer then sees (and caches) the shorter sequence, which is what a serving
engine can do without per-layer sequence lengths: vLLM prunes multimodal tokens before the
language model in the same way (see the "Serving" design page). Survivors keep their
original positions; with a window-local pruner the kept count depends only on the image
shapes and the ratio, so it can be known before the prompt is scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..base import removed_names
from .core import Scheduler, StageSpec, check_fraction, check_windows
from .knob import REACH_TOLERANCE, check_target, out_of_reach, stage_cap

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

    def at_kept_fraction(self, kept_fraction, num_layers, max_removal_ratio=1.0):
        """The one stage before the LLM at removal ratio ``1 - kept_fraction``: every layer
        caches what it keeps (at most its policies' limit).

        Raises:
            KeptFractionOutOfReach: ``1 - kept_fraction`` beyond that limit by more than
                `REACH_TOLERANCE`.
        """
        t = check_target(kept_fraction)
        self._check_depth(num_layers)
        limit = stage_cap(max_removal_ratio, 0, self.plan(num_layers)[0])
        if 1.0 - t <= limit:
            return replace(self, removal_ratio=1.0 - t)
        if 1.0 - limit > t + REACH_TOLERANCE:
            how = f"its one stage before the LLM (removal ratio at most {limit:g})"
            raise out_of_reach(t, 1.0 - limit, num_layers, how)
        return replace(self, removal_ratio=limit)

    def knob(self) -> str:
        return "the removal ratio of its one stage before the LLM (1 - kept_fraction)"
