"""The schedule of a pipeline config: one registered scheduler by name with its parameters.

The canonical form is that of every other policy spec, ``{name, params}``; the parameters
are the scheduler's non-default fields, so two configs are equal exactly when they build
equal schedulers. Two shorthands are accepted (and written back by ``to_yaml`` when they
give the same config):

* ``layers`` (with ``ratios`` and ``windows_per_side`` or ``window_size``; scalars are
  lists of one, neither window field means one window per image side) is ``explicit``;
* ``kept_fraction`` (with ``relative_layers``, ``windows_per_side`` and ``max_ratio``) is
  ``kept_fraction`` with ``target``; without ``windows_per_side`` the windows are 4/2/1 at
  the default relative layers and one per side otherwise, one value is broadcast.

Values are checked by the scheduler itself (its dataclass and `__post_init__`); its
`ScheduleError` names the field and entry, which become the YAML location.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..policies import ExplicitSchedule, KeptFractionSchedule, Scheduler
from .errors import _did_you_mean, _fail, _plain
from .specs import PolicySpec, _canonical_params, _coerce_params, _instantiate, _spec_of

__all__ = ["ScheduleConfig"]

_KF_DEFAULT = KeptFractionSchedule()
EXPLICIT_KEYS = ("layers", "ratios", "windows_per_side", "window_size")
KEPT_FRACTION_KEYS = ("kept_fraction", "relative_layers", "windows_per_side", "max_ratio")
KEYS = ("name", "params", "layers", "ratios", "windows_per_side", "window_size", "kept_fraction",
        "relative_layers", "max_ratio")
"""Every key a schedule mapping may hold (canonical and shorthand)."""
FORMS = ("layers", "kept_fraction", "name")
_ALLOWED = {"layers": set(EXPLICIT_KEYS), "kept_fraction": set(KEPT_FRACTION_KEYS), "name": {"name", "params"}}
_SHORT_NAME = {"target": "kept_fraction"}
"""Scheduler parameter -> its key in a shorthand (where they differ)."""


def _kf_default_windows(default_layers: bool, n: int) -> tuple[int, ...]:
    """Windows per side of a kept_fraction shorthand that gives none: the reference 4/2/1
    at the default relative layers, otherwise one window per image side."""
    return tuple(_KF_DEFAULT.windows_per_side) if default_layers else (1,) * n


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _pairs(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return [value]
    return value


def _from_explicit(data: dict[str, Any]) -> dict[str, Any]:
    """The ``explicit`` parameters of a ``layers:`` shorthand (with the checks that belong to
    the shorthand: ratios it requires, windows it does not let both be given)."""
    layers = _as_list(data["layers"])
    if isinstance(layers, list) and not layers:
        raise _fail("layers", "give at least one layer (an empty schedule compresses nothing)", ("layers",))
    if "ratios" not in data:
        n = len(layers) if isinstance(layers, list) else 1
        count = "one value" if n == 1 else f"1 or {n} values"
        raise _fail("ratios", f"an explicit schedule needs ratios ({count}), e.g. ratios: [0.5]", ("ratios",))
    if "windows_per_side" in data and "window_size" in data:
        raise _fail("windows", "give windows_per_side or window_size, not both", ("window_size",))
    params = {"layers": layers, "ratios": _as_list(data["ratios"])}
    if "window_size" in data:
        params["window_size"] = _pairs(data["window_size"])
    params["windows_per_side"] = _as_list(data["windows_per_side"]) if "windows_per_side" in data else None
    return params


def _from_kept_fraction(data: dict[str, Any]) -> dict[str, Any]:
    """The ``kept_fraction`` parameters of a ``kept_fraction:`` shorthand (windows broadcast
    or implied)."""
    params: dict[str, Any] = {"target": data["kept_fraction"]}
    rel = _as_list(data.get("relative_layers"))
    if rel is not None:
        params["relative_layers"] = rel
    n = len(rel) if isinstance(rel, list) else len(_KF_DEFAULT.relative_layers)
    if "windows_per_side" in data:
        wps = _as_list(data["windows_per_side"])
        if isinstance(wps, list) and len(wps) == 1:
            wps = wps * n
        elif isinstance(wps, list) and len(wps) != n:
            raise _fail("length", f"windows_per_side has {len(wps)} entries for {n} relative layers; give 1 or {n}",
                        ("windows_per_side",))
        params["windows_per_side"] = wps
    elif isinstance(rel, list):
        params["windows_per_side"] = list(_kf_default_windows(False, n))
    if "max_ratio" in data:
        params["max_ratio"] = data["max_ratio"]
    return params


def _no_bools(impl: type | None, params: dict[str, Any]) -> None:
    """Refuse True/False where a scheduler field wants numbers (pydantic's lax mode would
    read them as 1 and 0)."""
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


def _relocate(err: PydanticCustomError, form: str) -> PydanticCustomError:
    """``err`` (located inside ``{name, params}``) at its place in the form the user wrote."""
    ctx = err.context or {}
    sub = tuple(ctx.get("subloc", ()))
    if form != "name" and sub[:1] == ("params",):
        sub = sub[1:]
        sub = (_SHORT_NAME.get(sub[0], sub[0]),) + sub[1:] if sub else ()
    return _fail(err.type.removeprefix("lightkv_"), ctx.get("message", err.message()), sub)


def canonical_schedule(data: Any) -> Any:
    """``{name, params}`` of a schedule mapping in any accepted form, with the scheduler's
    non-default parameters (plain data).

    Raises:
        PydanticCustomError: what is wrong, located in the form given.
    """
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict):
        return data  # pydantic says "expected a mapping"
    data = {k: v for k, v in data.items() if v is not None}
    for key in data:
        if key not in KEYS:
            raise _fail("unknown_field", f"unknown field {key!r}{_did_you_mean(key, KEYS)} (allowed: {', '.join(KEYS)})",
                        (key,))
    forms = [f for f in FORMS if f in data]
    if len(forms) != 1:
        got = f"got {' and '.join(forms)}" if forms else "got none of them"
        raise _fail(
            "schedule_form",
            "give exactly one of layers (explicit stages), kept_fraction (a target the scheduler "
            f"turns into stages) or name (a registered scheduler); {got}",
        )
    form = forms[0]
    for key in data:
        if key not in _ALLOWED[form]:
            raise _fail("schedule_form", f"{key} cannot be combined with {form}; with {form} the schedule takes: "
                                         f"{', '.join(sorted(_ALLOWED[form]))}", (key,))
    if form == "layers":
        name, params = "explicit", _from_explicit(data)
    elif form == "kept_fraction":
        name, params = "kept_fraction", _from_kept_fraction(data)
    else:
        name, params = data["name"], data.get("params", {})
        if not isinstance(name, str):
            raise _fail("name", f"expected a registered scheduler name, got {name!r}", ("name",))
        if not isinstance(params, dict):
            raise _fail("params", f"expected a mapping of parameters, got {params!r}", ("params",))
    try:
        try:
            params = {str(k): _plain(v, str(k)) for k, v in params.items()}
        except PydanticCustomError as e:  # located by parameter name: inside params
            ctx = e.context or {}
            raise _fail("param_value", ctx.get("message", e.message()), ("params",) + tuple(ctx.get("subloc", ())))
        try:
            impl = Scheduler.lookup(name)
        except ValueError:
            impl = None  # reported by _coerce_params, with the registered names
        _no_bools(impl, params)
        spec = PolicySpec.model_construct(name=name, params=params)
        coerced = _coerce_params(Scheduler, spec, prefix=form == "name")
        scheduler = _instantiate(Scheduler, spec, prefix=form == "name")
    except PydanticCustomError as e:
        raise _relocate(e, form) from None
    return {"name": name, "params": _canonical(scheduler, name, params, coerced)}


def _canonical(scheduler: Scheduler, name: str, given: dict[str, Any], coerced: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's non-default parameters when they build it again (a dataclass that
    round-trips), otherwise the parameters as given (coerced, plain)."""
    if dataclasses.is_dataclass(scheduler) and Scheduler.registered().get(name) is type(scheduler):
        params = _spec_of(scheduler, "schedule").params
        try:
            again = _instantiate(Scheduler, PolicySpec.model_construct(name=name, params=params))
        except PydanticCustomError:
            again = None
        if again == scheduler:
            return params
    return _canonical_params(given, coerced)


class ScheduleConfig(BaseModel):
    """Where the stages run, with which windows and ratios: a registered scheduler.

    Canonically ``{name: ..., params: {...}}`` like every policy (``explicit``,
    ``kept_fraction``, ``scaled``, ``budget`` or a third-party scheduler); the shorthands
    ``layers: ...`` (explicit stages) and ``kept_fraction: ...`` (a target) normalise to it,
    so equal schedules compare equal whichever form they were written in.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="A registered scheduler (see `lightkv.policies.FAMILIES['scheduler']`).")
    params: dict[str, Any] = Field(
        default_factory=dict, description="The scheduler's parameters that differ from its defaults."
    )

    FORMS: ClassVar[tuple[str, ...]] = FORMS
    """The shorthands and the canonical form, by the key that marks them."""

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        return canonical_schedule(data)

    # ------------------------------------------------------------------ building
    def build(self) -> Scheduler:
        """The `Scheduler` this schedule describes (a new object on every call)."""
        return _instantiate(Scheduler, PolicySpec.model_construct(name=self.name, params=dict(self.params)))  # type: ignore[return-value]

    def max_stages(self) -> int | None:
        """How many stages the schedule has at most (None when that depends on the depth)."""
        return self.build().max_stages()

    @classmethod
    def from_scheduler(cls, scheduler: Scheduler) -> ScheduleConfig:
        """The schedule config of a (registered) scheduler object."""
        spec = _spec_of(scheduler, "schedule")
        return cls.model_validate({"name": spec.name, "params": spec.params})

    # ------------------------------------------------------------------ shorthand views
    @property
    def form(self) -> str:
        """The form `to_yaml_value` writes: ``"layers"``, ``"kept_fraction"`` or ``"name"``."""
        value = self.to_yaml_value()
        return next(f for f in FORMS if f in value)

    def _explicit(self) -> ExplicitSchedule | None:
        scheduler = self.build() if self.name == "explicit" else None
        return scheduler if type(scheduler) is ExplicitSchedule else None

    @property
    def layers(self) -> list[int] | None:
        """The layers of an explicit schedule (None for other schedulers)."""
        s = self._explicit()
        return None if s is None else list(s.layers)

    @property
    def ratios(self) -> list[float] | None:
        """The ratios of an explicit schedule (None for other schedulers)."""
        s = self._explicit()
        return None if s is None else [float(r) for r in s.ratios]

    @property
    def windows_per_side(self) -> list[int] | None:
        """The windows per side of an explicit schedule (None if it has none or is not explicit)."""
        s = self._explicit()
        return None if s is None or s.windows_per_side is None else list(s.windows_per_side)

    @property
    def window_size(self) -> list[tuple[int, int]] | None:
        """The window sizes of an explicit schedule (None if it has none or is not explicit)."""
        s = self._explicit()
        return None if s is None or s.window_size is None else [tuple(w) for w in s.window_size]  # type: ignore[misc]

    def _short(self) -> dict[str, Any] | None:
        s = self.build()
        if type(s) is ExplicitSchedule:
            out: dict[str, Any] = {"layers": list(s.layers), "ratios": [float(r) for r in s.ratios]}
            if s.window_size is not None:
                out["window_size"] = [list(w) for w in s.window_size]
            elif s.windows_per_side is not None:
                out["windows_per_side"] = list(s.windows_per_side)
            return out
        if type(s) is KeptFractionSchedule:
            rel_default = tuple(s.relative_layers) == tuple(_KF_DEFAULT.relative_layers)
            out = {"kept_fraction": float(s.target)}
            if not rel_default:
                out["relative_layers"] = [float(f) for f in s.relative_layers]
            if tuple(s.windows_per_side) != _kf_default_windows(rel_default, len(s.relative_layers)):
                out["windows_per_side"] = list(s.windows_per_side)
            if s.max_ratio != _KF_DEFAULT.max_ratio:
                out["max_ratio"] = float(s.max_ratio)
            return out
        return None

    def to_yaml_value(self) -> dict[str, Any]:
        """Plain data for YAML: a shorthand where it gives this same config, else ``{name, params}``."""
        short = self._short()
        if short is not None:
            try:
                if type(self).model_validate(short) == self:
                    return short
            except ValidationError:
                pass
        return {"name": self.name, "params": dict(self.params)} if self.params else {"name": self.name}

