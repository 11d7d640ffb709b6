"""`EpisodeStream`: an endless, seed-deterministic stream of one task's episodes.

Each task's data module subclasses it with its name, question types, splits, default
config and episode sampler; the stream itself is the same for all of them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

__all__ = ["EpisodeStream"]


class EpisodeStream:
    """An endless, seed-deterministic stream of episodes.

    Two streams with the same ``(seed, split, qtypes, config)`` yield identical episodes.
    ``qtypes`` restricts (and, with repeats, weights) the question types drawn.

    Args:
        seed: the stream's seed (with the task's name and the split).
        split: one of the task's splits.
        qtypes: question types to draw from (default: all of the task's).
        config: the task's ``GridConfig`` (default: its default config).
    """

    task: ClassVar[str]
    """The task's name (part of the seed, so tasks' streams differ)."""
    QTYPES: ClassVar[tuple[str, ...]]
    SPLITS: ClassVar[tuple[str, ...]]
    DEFAULT_CONFIG: ClassVar[Any]
    sample: ClassVar[Callable[..., Any]]
    """``sample(rng, split, qtype, config)``: the task's ``make_episode``."""

    def __init__(
        self,
        seed: int,
        split: str = "train",
        *,
        qtypes: Sequence[str] | None = None,
        config: Any = None,
    ) -> None:
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {self.SPLITS}, got {split!r}")
        qtypes = tuple(self.QTYPES if qtypes is None else qtypes)
        if not qtypes or any(q not in self.QTYPES for q in qtypes):
            raise ValueError(f"qtypes must be a non-empty subset of {self.QTYPES}, got {qtypes}")
        self.seed, self.split, self.qtypes = seed, split, qtypes
        self.config = self.DEFAULT_CONFIG if config is None else config
        self._rng = random.Random(f"{self.task}:{seed}:{split}")

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return type(self).sample(self._rng, self.split, self._rng.choice(self.qtypes), self.config)

    def take(self, n: int) -> list[Any]:
        """The next ``n`` episodes."""
        return [next(self) for _ in range(n)]
