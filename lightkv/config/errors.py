"""Configuration errors: `ConfigError`, did-you-mean suggestions, and the translation of
pydantic's validation errors into one line per problem with its YAML location."""

from __future__ import annotations

import difflib
import math
import reprlib
from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic_core import PydanticCustomError

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """An invalid pipeline configuration.

    Attributes:
        problems: ``(location, message)`` pairs; a location is a dotted path such as
            ``schedule.removal_ratios.0`` (empty for the document as a whole).
        source: what was being read (a file name or ``preset NAME``), or None.
    """

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__(self._render())

    MAX_LINES: ClassVar[int] = 10
    """At most this many problems are rendered (the rest are counted)."""

    def _render(self) -> str:
        prefix = f"{self.source}: " if self.source else ""
        shown = self.problems[: self.MAX_LINES]
        lines = [f"{prefix}{loc}: {msg}" if loc else f"{prefix}{msg}" for loc, msg in shown]
        if len(self.problems) > len(shown):
            lines.append(f"{prefix}... and {len(self.problems) - len(shown)} more problem(s)")
        return "\n".join(lines)

    def with_source(self, source: str) -> ConfigError:
        """The same problems, reported for ``source``."""
        return ConfigError(self.problems, source)


def _dotted(loc: Iterable[Any]) -> str:
    return ".".join(str(p) for p in loc)


_REPR = reprlib.Repr()
# reprlib walks only what it shows: a value expanded from YAML aliases (or a huge list)
# costs a few dozen elements to describe, never its full size.
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 2, 4, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40


def _short(value: Any, limit: int = 60) -> str:
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_KEYS = ("qwertyuiop", "asdfghjkl", "zxcvbnm")


def _adjacent(a: str, b: str) -> bool:
    """Whether two letters are neighbours on a QWERTY keyboard (a likely slip)."""
    pos = {ch: (r, i) for r, row in enumerate(_KEYS) for i, ch in enumerate(row)}
    if a not in pos or b not in pos:
        return False
    (ra, ia), (rb, ib) = pos[a], pos[b]
    if ra == rb:
        return abs(ia - ib) == 1
    if rb == ra + 1:  # each row sits half a key to the right of the one above
        return ib in (ia - 1, ia)
    if rb == ra - 1:
        return ib in (ia, ia + 1)
    return False


def _did_you_mean(word: Any, choices: Iterable[str], paren: bool = False) -> str:
    if not isinstance(word, str):
        return ""
    choices = list(choices)
    # A slipped key in what starts a longer name ('windowz' for 'windows_per_side') beats
    # difflib's overall similarity, which prefers the shorter 'window_size'.
    slips = [
        c
        for c in choices
        if len(word) >= 4
        and len(c) >= len(word)
        and c != word
        and sum(x != y for x, y in zip(word, c)) == 1
        and all(x == y or _adjacent(x, y) for x, y in zip(word, c))
    ]
    close = slips[:1] or difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {close[0]!r}?)" if paren else f"; did you mean {close[0]!r}?"


def _fail(
    kind: str,
    message: str,
    subloc: tuple[Any, ...] = (),
    also: Iterable[tuple[tuple[Any, ...], str]] = (),
) -> PydanticCustomError:
    """A validation error that `lightkv.config.errors_pydantic.translate_errors` reports as
    ``message``, at the location of the failing validator extended by ``subloc``; ``also``
    holds further ``(subloc, message)`` problems found by the same check (one line each:
    every bad field of a params block is reported, not only the first)."""
    context: dict[str, Any] = {"message": message, "subloc": subloc}
    more = tuple((tuple(loc), msg) for loc, msg in also)
    if more:
        context["also"] = more
    return PydanticCustomError(f"lightkv_{kind}", "{message}", context)


def _moved(err: PydanticCustomError, move: Any) -> PydanticCustomError:
    """``err`` with its location and those of its further problems passed through ``move``
    (a function of a subloc tuple): a check's error re-raised where the user wrote it."""
    ctx = err.context or {}
    return _fail(
        err.type.removeprefix("lightkv_"),
        ctx.get("message", err.message()),
        move(tuple(ctx.get("subloc", ()))),
        [(move(tuple(loc)), msg) for loc, msg in ctx.get("also", ())],
    )


# ---------------------------------------------------------------------------- plain values
_PLAIN = (str, int, float, bool, type(None))


def _plain(value: Any, where: str) -> Any:
    """Parameters as plain YAML/JSON values (tuples become lists)."""
    if isinstance(value, _PLAIN):
        if isinstance(value, float) and not math.isfinite(value):
            raise _fail(
                "param_value",
                f"parameter {where!r} must be a finite number, got {value!r}",
                (where,),
            )
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, where) for k, v in value.items()}
    raise _fail(
        "param_value",
        f"parameter {where!r} must be a plain value (number, string, bool, null, list or "
        f"mapping), got {_short(value)}",
        (where,),
    )
