"""Pydantic's validation errors in lightkv's words: one ``(location, message)`` each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import ConfigError, _did_you_mean, _dotted, _short
from .specs import STAGE_FIELDS

__all__ = ["translate_errors"]


def _is_policy_loc(loc: tuple[Any, ...]) -> bool:
    return bool(loc) and (
        (len(loc) == 1 and loc[0] in STAGE_FIELDS)
        or (len(loc) == 3 and loc[0] == "stage_overrides")
    )


def translate_errors(
    err: ValidationError, model_at: Callable[[tuple[Any, ...]], type[BaseModel]]
) -> ConfigError:
    """One ``(location, message)`` problem per pydantic error, in lightkv's words;
    ``model_at(loc)`` is the model whose fields apply at ``loc`` (for 'unknown field')."""
    problems = []
    for e in err.errors(include_url=False):
        ctx = e.get("ctx") or {}
        loc = tuple(e["loc"]) + tuple(ctx.get("subloc", ()))
        kind = e["type"]
        if loc and loc[-1] == "[key]":
            loc = loc[:-1]
            msg = (
                f"unknown field {loc[-1]!r}{_did_you_mean(loc[-1], STAGE_FIELDS)} "
                f"(allowed: {', '.join(STAGE_FIELDS)})"
            )
            if loc[0] == "stage_overrides" and len(loc) == 2:
                msg = f"stage index must be an integer, got {loc[-1]!r}"
        elif kind == "extra_forbidden":
            allowed = list(model_at(loc[:-1]).model_fields)
            msg = (
                f"unknown field {loc[-1]!r}{_did_you_mean(loc[-1], allowed)} "
                f"(allowed: {', '.join(allowed)})"
            )
        elif kind == "missing":
            msg = "this field is required"
        elif kind in ("model_type", "model_attributes_type", "dict_type") and _is_policy_loc(loc):
            msg = (
                "expected a registered policy name or {name: ..., params: {...}}, "
                f"got {_short(e.get('input'))}"
            )
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            msg = f"expected a mapping of fields, got {_short(e.get('input'))}"
        elif kind.startswith("lightkv_"):
            msg = e["msg"]
        else:
            msg = f"{e['msg']}, got {_short(e.get('input'))}"
        problems.append((_dotted(loc), msg))
        problems += [(_dotted(tuple(e["loc"]) + sub), m) for sub, m in ctx.get("also", ())]
    return ConfigError(problems)
