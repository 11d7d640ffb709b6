"""Rank statistics for comparing an instrument with a published table: Spearman's rank
correlation (ties share their mean rank) and the mean absolute difference. Pure Python, no
dependencies, so the formulas can be checked against textbook ones."""

from __future__ import annotations

import math

__all__ = ["mean_absolute_difference", "spearman"]


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):  # ties share their mean rank
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation of paired lists (ties get their mean rank).

    Raises:
        ValueError: lists of different lengths, fewer than 2 points, or a constant list.
    """
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"spearman needs two lists of one length >= 2, got {len(x)}, {len(y)}")
    rx, ry = _ranks(list(x)), _ranks(list(y))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        raise ValueError("spearman is undefined for a constant list")
    return cov / math.sqrt(vx * vy)


def mean_absolute_difference(x: list[float], y: list[float]) -> float:
    """``mean(|x - y|)`` over paired lists."""
    if len(x) != len(y) or not x:
        raise ValueError(f"needs two non-empty lists of one length, got {len(x)}, {len(y)}")
    return sum(abs(a - b) for a, b in zip(x, y, strict=True)) / len(x)
