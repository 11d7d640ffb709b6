"""List arguments of the benchmarks (``--presets``, ``--methods``, ``--models``,
``--kept-fractions``, ...): stated limits, duplicates merged with a note.

A list multiplies the work (every preset at every kept fraction on every model), so each
has a limit, checked before any work: `MAX_NAMES` distinct names (there are fewer presets
and models than that; unknown names are refused anyway), `MAX_NUMBERS` distinct numbers
(kept fractions, image sides; each one is a run of every method). A repeated value would
run twice and write two equal rows: it is merged, and the run says so in one line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TypeVar

from .common import PROG, UsageError

__all__ = ["MAX_NAMES", "MAX_NUMBERS", "merged"]

MAX_NAMES = 64
"""The most distinct names one list argument takes (presets, methods, models, variants)."""
MAX_NUMBERS = 16
"""The most distinct numbers one list argument takes (kept fractions, sides)."""

T = TypeVar("T")


def merged(values: Sequence[T] | None, option: str, limit: int) -> tuple[T, ...] | None:
    """``values`` with duplicates merged (first occurrence kept, a note on stderr), or None
    when the option was not given.

    Raises:
        UsageError: more than ``limit`` distinct values (naming the option and the limit).
    """
    if values is None:
        return None
    unique = tuple(dict.fromkeys(values))
    if len(unique) > limit:
        raise UsageError(f"{option} takes at most {limit} distinct values, got {len(unique):,}")
    if len(unique) < len(values):
        dropped = len(values) - len(unique)
        print(
            f"{PROG}: note: {option}: {dropped:,} repeated value(s) merged; running "
            f"{' '.join(str(v) for v in unique)}",
            file=sys.stderr,
        )
    return unique
