"""`GenerateError`: a problem with what the user asked for, as a one-line message."""

from __future__ import annotations

__all__ = ["GenerateError"]


class GenerateError(Exception):
    """A problem with what the user asked for (one-line message)."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
