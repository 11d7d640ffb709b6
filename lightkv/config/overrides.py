"""Validation of ``stage_overrides``: every bad override reported, one line each."""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from ..policies import FAMILIES
from .checks import validated
from .errors import _fail, _moved
from .specs import STAGE_FIELDS, PolicySpec

__all__ = ["validated_overrides"]


def validated_overrides(
    overrides: dict[int, dict[str, PolicySpec | None]], model_name: str
) -> dict[int, dict[str, PolicySpec | None]]:
    """``{stage index: {field: spec}}`` in canonical order, each policy built once.

    Raises:
        PydanticCustomError: one bad override; ValidationError: several (one line each).
    """
    out: dict[int, dict[str, PolicySpec | None]] = {}
    problems: list[
        PydanticCustomError
    ] = []  # every bad override, not only the first (three were two)
    for index in sorted(overrides):
        if index < 0:
            problems.append(
                _fail(
                    "stage_index",
                    f"stage indices are 0-based and must be >= 0, got {index}",
                    (index,),
                )
            )
            continue
        fields: dict[str, PolicySpec | None] = {}
        for field in STAGE_FIELDS:  # canonical order
            if field not in overrides[index]:
                continue
            spec = overrides[index][field]
            if spec is None:
                if field != "scorer":
                    problems.append(
                        _fail("required", f"only scorer may be null, not {field}", (index, field))
                    )
                fields[field] = None
                continue
            try:
                fields[field] = validated(FAMILIES[field], spec)
            except PydanticCustomError as e:
                problems.append(_moved(e, lambda sub, at=(index, field): at + sub))
        out[index] = fields
    if len(problems) == 1:
        raise problems[0]
    if (
        problems
    ):  # several: pydantic merges a nested ValidationError under this field, one line each
        raise ValidationError.from_exception_data(
            model_name, [InitErrorDetails(type=p, loc=(), input=overrides) for p in problems]
        )
    return out
