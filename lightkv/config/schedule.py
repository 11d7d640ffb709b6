"""The schedule of a pipeline config: one registered scheduler by name with its parameters.

The canonical form is that of every other policy spec, ``{name, params}``; the parameters
are the scheduler's non-default fields, so two configs are equal exactly when they build
equal schedulers. A scheduler class may also declare a **shorthand**: a YAML key that marks
it (`Scheduler.shorthand`), the other keys it takes (`Scheduler.shorthand_keys`) and how
they become parameters (`Scheduler.from_shorthand`, `Scheduler.to_shorthand`). This module
finds shorthands in the scheduler registry, so a plugin scheduler has its own as the
built-in ones do:

* ``layers`` (with ``removal_ratios`` and ``windows_per_side`` or ``window_size``) is
  ``explicit`` (`lightkv.policies.ExplicitSchedule`);
* ``kept_fraction`` (with ``relative_layers``, ``windows_per_side`` and
  ``max_removal_ratio``) is ``kept_fraction`` (`lightkv.policies.KeptFractionSchedule`).

``to_yaml`` writes the shorthand of a scheduler that has one. Values are checked by the
scheduler itself (its dataclass and `__post_init__`), which is constructed once; its
`ScheduleError` names the field and entry, which become the YAML location. Renamed keys
(``ratios``, ``ratio``, ``max_ratio``, ``target``) are refused with a message naming the new
key (there is no release to stay compatible with, and an alias beside its new name was a
silent wrong configuration).
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from ..policies import ExplicitSchedule, ScheduleError, Scheduler
from ..policies.base import removed_field_message
from .errors import _did_you_mean, _fail, _moved, _plain
from .specs import PolicySpec, _build, _cached, _canonical, _jsonable, _no_bools, _spec_of

__all__ = ["ScheduleConfig", "shorthands"]

CANONICAL = ("name", "params")


def shorthands(plugins: bool = True) -> dict[str, tuple[str, type[Scheduler]]]:
    """Shorthand key -> ``(registered name, scheduler class)`` of every registered scheduler
    class that declares a shorthand: plugins included, or (``plugins=False``) only those
    loaded so far, without loading any."""
    out: dict[str, tuple[str, type[Scheduler]]] = {}
    registry = Scheduler.registered() if plugins else Scheduler.loaded()
    for name, impl in registry.items():
        key = impl.__dict__.get("shorthand")
        if key and key not in out and key not in CANONICAL:
            out[key] = (name, impl)
    return out


def _relocate(err: PydanticCustomError, form: str) -> PydanticCustomError:
    """``err`` (located inside ``{name, params}``) at its place in the form the user wrote
    (a shorthand's keys are the scheduler's parameter names)."""

    def move(sub: tuple[Any, ...]) -> tuple[Any, ...]:
        return sub[1:] if form != "name" and sub[:1] == ("params",) else sub

    return _moved(err, move)


def _form(data: dict[str, Any], short: dict[str, tuple[str, type[Scheduler]]]) -> str:
    """The form of a schedule mapping: ``"name"`` or a shorthand key."""
    markers = [k for k in (*short, "name") if k in data]
    if len(markers) == 1:
        return markers[0]
    described = [f"{k} (a {n} schedule)" for k, (n, _) in short.items()] + [
        "name (a registered scheduler)"
    ]
    got = f"got {' and '.join(markers)}" if markers else "got none of them"
    raise _fail("schedule_form", f"give exactly one of {', '.join(described)}; {got}")


def _keys(short: dict[str, tuple[str, type[Scheduler]]]) -> set[str]:
    """Every key a schedule mapping may hold with these shorthands."""
    keys = set(CANONICAL)
    for key, (_, impl) in short.items():
        keys |= {key, *impl.shorthand_keys}
    return keys


def canonical_schedule(data: Any) -> tuple[Any, Scheduler | None]:
    """``({name, params}, scheduler)`` of a schedule mapping in any accepted form: the
    scheduler's non-default parameters (plain data) and the scheduler itself, constructed
    once. Data that is not a mapping comes back as is (pydantic reports it).

    Raises:
        PydanticCustomError: what is wrong, located in the form given.
    """
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict):
        return data, None
    data = {k: v for k, v in data.items() if v is not None}
    short = shorthands(plugins=False)  # lightkv's own: loading plugins only when needed
    impl: type[Scheduler] | None  # a shorthand's scheduler class; None for the name form
    allowed: Collection[str]
    keys = _keys(short)
    if not set(data) <= keys:  # a key no loaded scheduler takes: perhaps a plugin's shorthand
        short = shorthands()
        keys = _keys(short)
    for key in data:
        for _, impl in short.values():  # a renamed shorthand key: name the new one
            removed = removed_field_message(impl, [key], "schedule")
            if removed is not None and key not in keys:
                raise _fail("removed_field", removed, (key,))
        if key not in keys:
            allowed = sorted(keys)
            raise _fail(
                "unknown_field",
                f"unknown field {key!r}{_did_you_mean(key, allowed)} "
                f"(allowed: {', '.join(allowed)})",
                (key,),
            )
    form = _form(data, short)
    if form == "name":
        allowed, impl = set(CANONICAL), None
    else:
        name, impl = short[form]
        allowed = {form, *impl.shorthand_keys}
    for key in data:
        if key not in allowed:
            raise _fail(
                "schedule_form",
                f"{key} cannot be combined with {form}; with {form} the schedule takes: "
                f"{', '.join(sorted(allowed))}",
                (key,),
            )
    if impl is not None:
        try:
            params = impl.from_shorthand(data)
        except ScheduleError as e:
            where = () if e.param is None else (e.param,) if e.index is None else (e.param, e.index)
            raise _fail("schedule_form", str(e), where) from None
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
            raise _moved(e, lambda sub: ("params",) + sub) from e
        try:
            lookup = Scheduler.lookup(name)
        except ValueError:
            lookup = None  # reported by _build, with the registered names
        removed = (
            None if lookup is None else removed_field_message(lookup, params, f"schedule {name!r}")
        )
        if removed is not None:
            assert lookup is not None  # removed is None without a class
            old = next(k for k in params if k in lookup.removed_fields)
            raise _fail("removed_param", removed, ("params", old))
        _no_bools(lookup, params)
        spec = PolicySpec.model_construct(name=name, params=params)
        scheduler, coerced = _build(Scheduler, spec, prefix=form == "name")
        return {"name": name, "params": _canonical(Scheduler, scheduler, name, coerced)}, scheduler
    except PydanticCustomError as e:
        raise _relocate(e, form) from None


class ScheduleConfig(BaseModel):
    """Where the stages run, with which windows and removal ratios: a registered scheduler.

    Canonically ``{name: ..., params: {...}}`` like every policy (``explicit``,
    ``kept_fraction``, ``scaled``, ``budget`` or a third-party scheduler); a scheduler's
    shorthand (``layers: ...``, ``kept_fraction: ...``, or a plugin's) normalises to it, so
    equal schedules compare equal whichever form they were written in.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        description="A registered scheduler (see `lightkv.policies.FAMILIES['scheduler']`)."
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="The scheduler's parameters that differ from its defaults.",
    )

    FORMS: ClassVar[tuple[str, ...]] = ("layers", "kept_fraction", "name")
    """The built-in shorthands and the canonical form, by the key that marks them (plugins
    may add shorthands: see `shorthands`)."""

    _built: Any = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _normalise(cls, data: Any, handler) -> ScheduleConfig:
        if isinstance(data, ScheduleConfig):
            return handler(data)
        canonical, scheduler = canonical_schedule(data)
        model = handler(canonical)
        if scheduler is not None:
            model._built = (model.name, copy.deepcopy(model.params), scheduler)
        return model

    def __eq__(self, other: object) -> bool:
        # The scheduler built during validation is a cache, not part of the value.
        return type(other) is type(self) and (self.name, self.params) == (other.name, other.params)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ building
    def _scheduler(self) -> Scheduler:
        """The scheduler validation built (shared: read only), or a new one after an edit."""
        cached = _cached(self._built, (self.name, self.params))
        if cached is None:
            cached = _build(
                Scheduler, PolicySpec.model_construct(name=self.name, params=dict(self.params))
            )[0]
        return cached  # type: ignore[return-value]

    def build(self) -> Scheduler:
        """The `Scheduler` this schedule describes: a copy of the one validation
        constructed (a new object on every call, without running its checks again)."""
        return copy.deepcopy(self._scheduler())

    def max_stages(self) -> int | None:
        """How many stages the schedule has at most (None when that depends on the depth)."""
        return self._scheduler().max_stages()

    @classmethod
    def from_scheduler(cls, scheduler: Scheduler) -> ScheduleConfig:
        """The schedule config of a (registered) scheduler object."""
        spec = _spec_of(scheduler, "schedule")
        return cls.model_validate({"name": spec.name, "params": spec.params})

    # ------------------------------------------------------------------ shorthand views
    @property
    def form(self) -> str:
        """The form `to_yaml_value` writes: a shorthand key (``"layers"``, ``"kept_fraction"``,
        a plugin's) or ``"name"``."""
        value = self.to_yaml_value()
        return next((k for k in value if k in shorthands()), "name")

    def _explicit(self) -> ExplicitSchedule | None:
        scheduler = self._scheduler() if self.name == "explicit" else None
        return scheduler if type(scheduler) is ExplicitSchedule else None

    @property
    def layers(self) -> list[int] | None:
        """The layers of an explicit schedule (None for other schedulers)."""
        s = self._explicit()
        return None if s is None else list(s.layers)

    @property
    def removal_ratios(self) -> list[float] | None:
        """The removal ratios of an explicit schedule (None for other schedulers)."""
        s = self._explicit()
        return None if s is None else [float(r) for r in s.removal_ratios]

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

    def to_yaml_value(self) -> dict[str, Any]:
        """Plain data for YAML: the scheduler's shorthand where its class declares one,
        else ``{name, params}``."""
        s = self._scheduler()
        short = shorthands().get(type(s).__dict__.get("shorthand") or "")
        if short is not None and short == (self.name, type(s)):
            value = s.to_shorthand()
            if value is not None:
                return {k: _plain(_jsonable(v), k) for k, v in value.items()}
        return (
            {"name": self.name, "params": dict(self.params)} if self.params else {"name": self.name}
        )
