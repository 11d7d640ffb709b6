"""Policies by registered name: `PolicySpec`, parameter coercion to the policy's field types,
instantiation, and the spec of a policy object."""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .. import methods as _methods  # noqa: F401  (registers the published methods' policies)
from ..policies import FAMILIES, Mode, Policy
from ..policies.base import removed_field_message
from .errors import ConfigError, _did_you_mean, _fail, _plain, _short

__all__ = ["STAGE_FIELDS", "PolicySpec"]

STAGE_FIELDS: tuple[str, ...] = ("partitioner", "scorer", "pruner", "passer", "relevance")
"""The policy fields of a stage, in config order."""

StageField = Literal["partitioner", "scorer", "pruner", "passer", "relevance"]


def _error_loc(error: BaseException | None) -> tuple[Any, ...]:
    """Where inside the parameters an error raised by a policy points: a `ScheduleError`
    (or any error with ``param`` / ``index`` attributes) names its field and entry."""
    param = getattr(error, "param", None)
    if not isinstance(param, str):
        return ()
    index = getattr(error, "index", None)
    return (param,) if index is None else (param, index)


class PolicySpec(BaseModel):
    """One policy by registered name, with its parameters.

    In YAML a policy without parameters can be written as its bare name
    (``scorer: cosine``); otherwise ``{name: ..., params: {...}}``.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The policy's registered name (see `lightkv.policies.FAMILIES`).")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Constructor parameters (the policy dataclass's fields)."
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"name": data}
        if isinstance(data, Policy):
            raise _fail(
                "policy_object",
                "give a policy by name ({name: ..., params: ...}), not a Python object",
            )
        return data

    @field_validator("params")
    @classmethod
    def _plain_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        return {str(k): _plain(v, str(k)) for k, v in params.items()}

    _built: Any = PrivateAttr(default=None)
    """``(name, params, policy)`` as validated by a config (see `built`)."""

    def to_yaml_value(self) -> str | dict[str, Any]:
        """The canonical YAML form: the bare name when there are no parameters."""
        return {"name": self.name, "params": dict(self.params)} if self.params else self.name

    def __eq__(self, other: object) -> bool:
        # The policy built during validation is a cache, not part of the value.
        return type(other) is type(self) and (self.name, self.params) == (other.name, other.params)  # type: ignore[attr-defined]

    def built(self) -> Policy | None:
        """The policy a config constructed when it validated this spec, while name and
        parameters are unchanged since (None otherwise)."""
        return _cached(self._built, (self.name, self.params))

    def _remember(self, policy: Policy) -> PolicySpec:
        self._built = (self.name, copy.deepcopy(self.params), policy)
        return self


def _cached(built: Any, now: Any) -> Any:
    """The object of a ``(*key, object)`` cache entry while its key equals ``now``."""
    if built is None or tuple(built[:-1]) != tuple(now):
        return None
    return built[-1]


@functools.cache
def _adapter(impl: type) -> TypeAdapter | None:
    if not dataclasses.is_dataclass(impl):
        return None
    try:
        return TypeAdapter(impl)
    except Exception:  # noqa: BLE001  (a third-party dataclass pydantic cannot describe: names only)
        return None


@functools.cache
def _field_adapters(impl: type) -> dict[str, TypeAdapter] | None:
    """One pydantic adapter per init field of a policy dataclass, to convert parameters to
    the declared types without constructing the policy (None: types pydantic cannot
    describe, so names only are checked)."""
    if not dataclasses.is_dataclass(impl):
        return None
    try:
        hints = typing.get_type_hints(impl)
        return {f.name: TypeAdapter(hints[f.name]) for f in dataclasses.fields(impl) if f.init}
    except Exception:  # noqa: BLE001  (a third-party annotation pydantic cannot describe)
        return None


def _no_bools(impl: type | None, params: dict[str, Any]) -> None:
    """Refuse True/False where a policy's or scheduler's field wants numbers (pydantic's lax
    mode would read them as 1 and 0: ``frames: true`` was a valid one-frame window)."""
    if impl is None or not dataclasses.is_dataclass(impl):
        return
    types = {f.name: str(f.type) for f in dataclasses.fields(impl)}
    for key, value in params.items():
        if "bool" in types.get(key, "bool"):
            continue
        values = value if isinstance(value, list) else [value]
        for i, v in enumerate(values):
            if isinstance(v, bool):
                kind = "integer" if "int" in types[key] else "number"
                where = ("params", key, i) if isinstance(value, list) else ("params", key)
                raise _fail("param_value", f"Input should be a valid {kind}, got {v!r}", where)


def _coerce_params(family: type[Policy], spec: PolicySpec, prefix: bool = True) -> dict[str, Any]:
    """Check ``spec`` against ``family``'s registry and the policy's parameter types.

    Returns the parameters converted to the types the policy declares (e.g. YAML lists
    to tuples) (a renamed parameter's old name is refused, naming the new one), ready for
    ``family.create``; nothing is constructed. Messages about values start with the family
    and name (``scheduler 'explicit': ...``) unless ``prefix`` is false.

    Raises:
        PydanticCustomError: unknown name, unknown parameter or a badly typed value.
    """
    try:
        impl = family.lookup(spec.name)
    except ValueError as e:
        raise _fail(
            "unknown_policy", f"{e}{_did_you_mean(spec.name, family.registered())}", ("name",)
        ) from None
    params = dict(spec.params)
    removed = removed_field_message(impl, params, f"{family.family} {spec.name!r}")
    if removed is not None:
        old = next(k for k in params if k in impl.removed_fields)
        raise _fail("removed_param", removed, ("params", old))
    if not dataclasses.is_dataclass(impl):
        return params
    fields = {f.name: f for f in dataclasses.fields(impl) if f.init}
    bad = [k for k in params if k not in fields]
    if bad:
        allowed = ", ".join(sorted(fields)) or "(none)"
        raise _fail(
            "unknown_param",
            f"{family.family} {spec.name!r} has no parameter "
            f"{bad[0]!r}{_did_you_mean(bad[0], fields, paren=True)}; "
            f"its parameters are: {allowed}",
            ("params", bad[0]),
        )
    _no_bools(impl, params)
    adapters = _field_adapters(impl)
    if adapters is None or not params:
        return params
    label = f"{family.family} {spec.name!r}: " if prefix else ""
    out, problems = {}, []
    for key in fields:  # field order; every bad value of every field is reported
        if key not in params:
            continue
        try:
            out[key] = adapters[key].validate_python(params[key])
        except ValidationError as e:
            problems += [
                (
                    ("params", key) + tuple(err["loc"]),
                    f"{label}{err['msg']}, got {_short(err.get('input'))}",
                )
                for err in e.errors(include_url=False)
            ]
    if problems:
        (loc, msg), *rest = problems
        raise _fail("param_value", msg, loc, rest)
    return {k: out[k] for k in params}


_P = TypeVar("_P", bound=Policy)


def _build(family: type[_P], spec: PolicySpec, prefix: bool = True) -> tuple[_P, dict[str, Any]]:
    """The policy ``spec`` names, constructed once, and its coerced parameters.

    Raises:
        PydanticCustomError: as `_coerce_params`, or the policy's own checks failed.
    """
    params = _coerce_params(family, spec, prefix)
    try:
        return family.create(spec.name, **params), params
    except (ValueError, TypeError) as e:
        label = f"{family.family} {spec.name!r}: " if prefix else ""
        raise _fail("param_value", f"{label}{e}", ("params",) + _error_loc(e)) from None


def _instantiate(family: type[_P], spec: PolicySpec, prefix: bool = True) -> _P:
    return _build(family, spec, prefix)[0]


def _spec_of(policy: Policy, where: str) -> PolicySpec:
    """The `PolicySpec` of a policy object: its registered name and non-default parameters."""
    name = type(policy).name
    families = [*FAMILIES.values(), Mode]
    family = next((f for f in families if isinstance(policy, f)), None)
    if not name or family is None or family._registry.get(name) is not type(policy):
        raise ConfigError(
            [
                (
                    where,
                    (
                        f"{type(policy).__qualname__} is not a registered policy; register it with "
                        "@<Family>.register('name') to describe it in a config"
                    ),
                )
            ]
        )
    params: dict[str, Any] = {}
    if dataclasses.is_dataclass(policy):
        for f in dataclasses.fields(policy):
            if not f.init:
                continue
            value = getattr(policy, f.name)
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                default = f.default_factory()  # type: ignore[misc]
            else:
                default = dataclasses.MISSING
            if default is dataclasses.MISSING or _jsonable(value) != _jsonable(default):
                params[f.name] = _jsonable(value)
    return PolicySpec(name=name, params=params)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _canonical(
    family: type[Policy], policy: Policy, name: str, coerced: dict[str, Any]
) -> dict[str, Any]:
    """The parameters a config stores for ``policy`` (built from ``coerced``): its
    non-default fields, as ``to_yaml`` of a pipeline object writes them, when they build it
    again; otherwise the parameters as given (coerced, plain).

    Only a policy whose `__post_init__` changed a value is constructed a second time to
    check that; for every other one the non-default fields are the given ones."""
    plain = {k: _plain(_jsonable(v), k) for k, v in coerced.items()}
    if not (dataclasses.is_dataclass(policy) and family.loaded().get(name) is type(policy)):
        return plain
    params = _spec_of(policy, family.family).params
    expected = {
        f.name: _jsonable(
            f.default if f.default is not dataclasses.MISSING else f.default_factory()
        )
        for f in dataclasses.fields(policy)
        if f.init
        and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
    }
    expected.update(plain)
    if all(_jsonable(getattr(policy, k)) == v for k, v in expected.items()):
        return params
    try:
        again = _build(family, PolicySpec.model_construct(name=name, params=params))[0]
    except PydanticCustomError:
        again = None
    return params if again == policy else plain
