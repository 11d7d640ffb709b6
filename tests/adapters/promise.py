"""What a schedule promises, computed independently of lightkv's graph code.

Windows are near-equal bands per image side (``r * n_r // h``); a window of ``n`` tokens
with at least one destination loses ``floor(P * n)`` tokens (parity split, ``P <= 0.5``).
"""

from __future__ import annotations

import math


def bands(size: int, parts: int) -> list[int]:
    parts = min(parts, size)
    counts = [0] * parts
    for r in range(size):
        counts[r * parts // size] += 1
    return counts


def removed_first_stage(grid: tuple[int, int], windows_per_side: int, ratio: float) -> int:
    """Tokens removed from a full ``h x w`` grid by a windowed stage."""
    h, w = grid
    total = 0
    for rh in bands(h, windows_per_side):
        for cw in bands(w, windows_per_side):
            n = rh * cw
            total += math.floor(ratio * n) if n >= 2 else 0
    return total


def removed_global(n: int, ratio: float) -> int:
    """Tokens removed from ``n`` survivors of one image by a one-window stage."""
    return math.floor(ratio * n) if n >= 2 else 0


def promised_vision(
    grids: list[tuple[int, int]], windows: tuple[int, int], ratio: float
) -> tuple[int, int, int]:
    """Vision tokens of one batch row before, after stage 1 (``windows[0]`` per side) and
    after stage 2 (``windows[1]`` must be 1)."""
    assert windows[1] == 1
    before = sum(h * w for h, w in grids)
    after1 = [h * w - removed_first_stage((h, w), windows[0], ratio) for h, w in grids]
    after2 = [n - removed_global(n, ratio) for n in after1]
    return before, sum(after1), sum(after2)
