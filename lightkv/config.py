"""Declarative pipelines: the pydantic schema, YAML in and out, JSON Schema.

A `PipelineConfig` fully describes a `lightkv.Pipeline`: its schedule and, for each stage,
the policy of each family by registered name with its parameters. It is the single source
of truth for presets (``lightkv/presets/*.yaml``), user files and the JSON Schema.

```yaml
name: my-lightkv
summary: LightKV with L2 edges in the last stage
schedule:
  layers: [12, 18, 24]          # 0-based decoder layers after which a stage runs
  ratios: [0.5]                 # removal ratio per stage (one value is broadcast)
  windows_per_side: [4, 2, 1]   # or window_size: [[6, 6]], or neither (one window)
partitioner: grid               # a registered name ...
scorer: cosine
pruner: divergence
passer: relevance_mean
relevance: query_softmax
stage_overrides:
  2:
    scorer: {name: l2}          # ... or {name: ..., params: {...}}
```

Instead of ``layers`` a schedule can give a target (``kept_fraction: 0.55``, turned into
layers and a ratio for the model's depth) or name a registered scheduler
(``name: my_schedule`` with ``params``). Policy names are checked against the family
registries (`lightkv.policies.FAMILIES`), which include third-party policies registered
with a decorator or through the ``lightkv.policies`` entry-point group.

Invalid configurations raise `ConfigError`, whose message names the field, the bad value
and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import reprlib
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .pipeline import Pipeline, Stage
from .policies import FAMILIES, ExplicitSchedule, KeptFractionSchedule, Policy, Scheduler, StageSpec
from .policies import pooling as _pooling  # noqa: F401  (registers the "anchor" and "strided" partitioners)
from .policies.schedulers import average_kept_fraction

__all__ = [
    "STAGE_FIELDS",
    "ConfigError",
    "PipelineConfig",
    "PolicySpec",
    "ScheduleConfig",
    "config_from_pipeline",
    "json_schema",
    "load_config",
    "pipeline_from_yaml",
    "pipeline_to_yaml",
    "read_config_text",
    "MAX_CONFIG_BYTES",
]

STAGE_FIELDS: tuple[str, ...] = ("partitioner", "scorer", "pruner", "passer", "relevance")
"""The policy fields of a stage, in config order."""

StageField = Literal["partitioner", "scorer", "pruner", "passer", "relevance"]


# ---------------------------------------------------------------------------- errors
class ConfigError(ValueError):
    """An invalid pipeline configuration.

    Attributes:
        problems: ``(location, message)`` pairs; a location is a dotted path such as
            ``schedule.ratios.0`` (empty for the document as a whole).
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
    slips = [c for c in choices if len(word) >= 4 and len(c) >= len(word) and c != word
             and sum(x != y for x, y in zip(word, c)) == 1
             and all(x == y or _adjacent(x, y) for x, y in zip(word, c))]
    close = slips[:1] or difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {close[0]!r}?)" if paren else f"; did you mean {close[0]!r}?"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The model whose field set applies at ``loc`` (for 'unknown field' messages)."""
    if not loc:
        return PipelineConfig
    if loc[0] == "schedule":
        return ScheduleConfig if len(loc) == 1 else PolicySpec
    return PolicySpec


def _is_policy_loc(loc: tuple[Any, ...]) -> bool:
    return bool(loc) and (
        (len(loc) == 1 and loc[0] in STAGE_FIELDS) or (len(loc) == 3 and loc[0] == "stage_overrides")
    )


def _from_validation_error(err: ValidationError) -> ConfigError:
    problems = []
    for e in err.errors(include_url=False):
        ctx = e.get("ctx") or {}
        loc = tuple(e["loc"]) + tuple(ctx.get("subloc", ()))
        kind = e["type"]
        if loc and loc[-1] == "[key]":
            loc = loc[:-1]
            msg = f"unknown field {loc[-1]!r}{_did_you_mean(loc[-1], STAGE_FIELDS)} (allowed: {', '.join(STAGE_FIELDS)})"
            if loc[0] == "stage_overrides" and len(loc) == 2:
                msg = f"stage index must be an integer, got {loc[-1]!r}"
        elif kind == "extra_forbidden":
            allowed = list(_model_at(loc[:-1]).model_fields)
            msg = f"unknown field {loc[-1]!r}{_did_you_mean(loc[-1], allowed)} (allowed: {', '.join(allowed)})"
        elif kind == "missing":
            msg = "this field is required"
        elif kind in ("model_type", "model_attributes_type", "dict_type") and _is_policy_loc(loc):
            msg = f"expected a registered policy name or {{name: ..., params: {{...}}}}, got {_short(e.get('input'))}"
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            msg = f"expected a mapping of fields, got {_short(e.get('input'))}"
        elif kind.startswith("lightkv_"):
            msg = e["msg"]
        else:
            msg = f"{e['msg']}, got {_short(e.get('input'))}"
        problems.append((_dotted(loc), msg))
    return ConfigError(problems)


def _fail(kind: str, message: str, subloc: tuple[Any, ...] = ()) -> PydanticCustomError:
    return PydanticCustomError(f"lightkv_{kind}", "{message}", {"message": message, "subloc": subloc})


# ---------------------------------------------------------------------------- policies
_PLAIN = (str, int, float, bool, type(None))


def _plain(value: Any, where: str) -> Any:
    """Parameters as plain YAML/JSON values (tuples become lists)."""
    if isinstance(value, _PLAIN):
        if isinstance(value, float) and not math.isfinite(value):
            raise _fail("param_value", f"parameter {where!r} must be a finite number, got {value!r}", (where,))
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, where) for k, v in value.items()}
    raise _fail(
        "param_value",
        f"parameter {where!r} must be a plain value (number, string, bool, null, list or mapping), got {_short(value)}",
        (where,),
    )


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
            raise _fail("policy_object", "give a policy by name ({name: ..., params: ...}), not a Python object")
        return data

    @field_validator("params")
    @classmethod
    def _plain_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        return {str(k): _plain(v, str(k)) for k, v in params.items()}

    def to_yaml_value(self) -> str | dict[str, Any]:
        """The canonical YAML form: the bare name when there are no parameters."""
        return {"name": self.name, "params": dict(self.params)} if self.params else self.name


@functools.cache
def _adapter(impl: type) -> TypeAdapter | None:
    if not dataclasses.is_dataclass(impl):
        return None
    try:
        return TypeAdapter(impl)
    except Exception:  # noqa: BLE001  (a third-party dataclass pydantic cannot describe: names only)
        return None


def _coerce_params(family: type[Policy], spec: PolicySpec) -> dict[str, Any]:
    """Check ``spec`` against ``family``'s registry and the policy's parameter types.

    Returns the parameters converted to the types the policy declares (e.g. YAML lists
    to tuples), ready for ``family.create``.

    Raises:
        PydanticCustomError: unknown name, unknown parameter or a badly typed value.
    """
    try:
        impl = family.lookup(spec.name)
    except ValueError as e:
        raise _fail("unknown_policy", f"{e}{_did_you_mean(spec.name, family.registered())}", ("name",)) from None
    params = dict(spec.params)
    if not dataclasses.is_dataclass(impl):
        return params
    fields = {f.name: f for f in dataclasses.fields(impl) if f.init}
    bad = [k for k in params if k not in fields]
    if bad:
        allowed = ", ".join(sorted(fields)) or "(none)"
        raise _fail(
            "unknown_param",
            f"{family.family} {spec.name!r} has no parameter {bad[0]!r}{_did_you_mean(bad[0], fields, paren=True)}; "
            f"its parameters are: {allowed}",
            ("params", bad[0]),
        )
    adapter = _adapter(impl)
    if adapter is None or not params:
        return params
    try:
        validated = adapter.validate_python(params)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = tuple(first["loc"])
        if first["type"] == "value_error":  # raised by the policy's own checks
            detail = str((first.get("ctx") or {}).get("error", first["msg"]))
        else:
            detail = f"{first['msg']}, got {_short(first.get('input'))}"
        raise _fail("param_value", f"{family.family} {spec.name!r}: {detail}", ("params",) + where) from None
    except (ValueError, TypeError) as e:  # raised by the policy's own __post_init__
        raise _fail("param_value", f"{family.family} {spec.name!r}: {e}", ("params",)) from None
    return {k: getattr(validated, k) for k in params}


def _instantiate(family: type[Policy], spec: PolicySpec) -> Policy:
    params = _coerce_params(family, spec)
    try:
        return family.create(spec.name, **params)
    except (ValueError, TypeError) as e:
        raise _fail("param_value", f"{family.family} {spec.name!r}: {e}", ("params",)) from None


def _spec_of(policy: Policy, where: str) -> PolicySpec:
    """The `PolicySpec` of a policy object: its registered name and non-default parameters."""
    name = type(policy).name
    family = next((f for f in FAMILIES.values() if isinstance(policy, f)), None)
    if not name or family is None or family._registry.get(name) is not type(policy):
        raise ConfigError(
            [(where, (f"{type(policy).__qualname__} is not a registered policy; register it with "
                      "@<Family>.register('name') to describe it in a config"))]
        )
    params = {}
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


# ---------------------------------------------------------------------------- schedule
_KF_DEFAULT = KeptFractionSchedule()


def _kf_default_windows(default_layers: bool, n: int) -> tuple[int, ...]:
    """Windows per side of a kept_fraction schedule that gives none: the reference 4/2/1
    at the default relative layers, otherwise one window per image side."""
    return tuple(_KF_DEFAULT.windows_per_side) if default_layers else (1,) * n
def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value


class ScheduleConfig(BaseModel):
    """Where the stages run, with which windows and ratios. Exactly one of three forms:

    * explicit: ``layers`` (0-based decoder layers after which a stage runs, strictly
      increasing), ``ratios`` (removal ratio per stage in ``[0, 1)``; one value is
      broadcast) and optionally ``windows_per_side`` or ``window_size`` (one entry per
      stage or one for all; neither means one window per image side);
    * target: ``kept_fraction`` (vision-KV fraction to keep, averaged over layers, in
      ``(0, 1]``), optionally ``relative_layers`` (stage positions as fractions of depth)
      and ``windows_per_side``; layers and a common ratio follow from the model's depth;
    * registered: ``name`` of a registered scheduler and its ``params``.
    """

    model_config = ConfigDict(extra="forbid")

    layers: list[StrictInt] | None = Field(None, description="0-based decoder layers, strictly increasing.")
    ratios: list[StrictFloat] | None = Field(None, description="Removal ratio per stage, each in [0, 1).")
    windows_per_side: list[StrictInt] | None = Field(None, description="Windows per image side per stage.")
    window_size: list[tuple[StrictInt, StrictInt]] | None = Field(
        None, description="Window (rows, cols) in tokens per stage."
    )
    kept_fraction: StrictFloat | None = Field(None, description="Target kept vision-KV fraction in (0, 1].")
    relative_layers: list[StrictFloat] | None = Field(
        None, description="Stage positions as fractions of depth, each in [0, 1] (with kept_fraction)."
    )
    name: str | None = Field(None, description="A registered scheduler (instead of layers or kept_fraction).")
    params: dict[str, Any] | None = Field(None, description="Parameters of the registered scheduler.")

    FORMS: ClassVar[tuple[str, ...]] = ("layers", "kept_fraction", "name")

    @field_validator("layers", "ratios", "windows_per_side", "relative_layers", mode="before")
    @classmethod
    def _scalar_to_list(cls, value: Any) -> Any:
        return _as_list(value)

    @field_validator("window_size", mode="before")
    @classmethod
    def _pair_to_list(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
            return [value]
        return value

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, layers: list[int] | None) -> list[int] | None:
        if layers is None:
            return None
        if not layers:
            raise _fail("layers", "give at least one layer (an empty schedule compresses nothing)")
        for i, layer in enumerate(layers):
            if layer < 0:
                raise _fail("layers", f"layer indices are 0-based and must be >= 0, got {layer}", (i,))
        for i in range(1, len(layers)):
            if layers[i] <= layers[i - 1]:
                raise _fail("layers", f"layers must be strictly increasing, got {layers}", (i,))
        return layers

    @field_validator("ratios")
    @classmethod
    def _check_ratios(cls, ratios: list[float] | None) -> list[float] | None:
        if ratios is None:
            return None
        if not ratios:
            raise _fail("ratios", "give at least one removal ratio, e.g. [0.5]")
        for i, r in enumerate(ratios):
            if not (0.0 <= r < 1.0):
                raise _fail("ratio", f"removal ratio must be in [0, 1) (0 keeps every token), got {r!r}", (i,))
        return ratios

    @field_validator("windows_per_side")
    @classmethod
    def _check_windows(cls, wps: list[int] | None) -> list[int] | None:
        if wps is None:
            return None
        if not wps:
            raise _fail("windows", "give at least one value, e.g. [4, 2, 1]")
        for i, w in enumerate(wps):
            if w < 1:
                raise _fail("windows", f"windows per side must be a positive integer, got {w}", (i,))
        return wps

    @field_validator("window_size")
    @classmethod
    def _check_window_size(cls, sizes: list[tuple[int, int]] | None) -> list[tuple[int, int]] | None:
        if sizes is None:
            return None
        if not sizes:
            raise _fail("windows", "give at least one (rows, cols) pair, e.g. [[6, 6]]")
        for i, (r, c) in enumerate(sizes):
            if r < 1 or c < 1:
                raise _fail("windows", f"window (rows, cols) must be positive, got {[r, c]}", (i,))
        return sizes

    @field_validator("kept_fraction")
    @classmethod
    def _check_kept(cls, value: float | None) -> float | None:
        if value is not None and not (0.0 < value <= 1.0):
            raise _fail("kept_fraction", f"kept_fraction must be in (0, 1], got {value!r}")
        return value

    @field_validator("relative_layers")
    @classmethod
    def _check_relative(cls, rel: list[float] | None) -> list[float] | None:
        if rel is None:
            return None
        if not rel:
            raise _fail("relative_layers", "give at least one relative layer, e.g. [0.375, 0.5625, 0.75]")
        for i, f in enumerate(rel):
            if not (0.0 <= f <= 1.0):
                raise _fail("relative_layers", f"relative layers are fractions of depth in [0, 1], got {f!r}", (i,))
        return rel

    @field_validator("params")
    @classmethod
    def _plain_params(cls, params: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if params is None else {str(k): _plain(v, str(k)) for k, v in params.items()}

    @model_validator(mode="after")
    def _check_form(self) -> ScheduleConfig:
        forms = [f for f in self.FORMS if getattr(self, f) is not None]
        if len(forms) != 1:
            got = f"got {' and '.join(forms)}" if forms else "got none of them"
            raise _fail(
                "schedule_form",
                "give exactly one of layers (explicit stages), kept_fraction (a target the scheduler "
                f"turns into stages) or name (a registered scheduler); {got}",
            )
        form = forms[0]
        allowed = {
            "layers": {"layers", "ratios", "windows_per_side", "window_size"},
            "kept_fraction": {"kept_fraction", "relative_layers", "windows_per_side"},
            "name": {"name", "params"},
        }[form]
        for f in type(self).model_fields:
            if f not in allowed and getattr(self, f) is not None:
                raise _fail(
                    "schedule_form",
                    f"{f} cannot be combined with {form}; with {form} the schedule takes: {', '.join(sorted(allowed))}",
                    (f,),
                )
        if form == "layers":
            n = len(self.layers)  # type: ignore[arg-type]
            if self.ratios is None:
                count = "one value" if n == 1 else f"1 or {n} values"
                raise _fail("ratios", f"an explicit schedule needs ratios ({count}), e.g. ratios: [0.5]", ("ratios",))
            if self.windows_per_side is not None and self.window_size is not None:
                raise _fail("windows", "give windows_per_side or window_size, not both", ("window_size",))
            for f in ("ratios", "windows_per_side", "window_size"):
                values = getattr(self, f)
                if values is not None and len(values) not in (1, n):
                    raise _fail("length", f"{f} has {len(values)} entries for {n} layers; give 1 or {n}", (f,))
        elif form == "kept_fraction":
            n = len(self.relative_layers or _KF_DEFAULT.relative_layers)
            if self.windows_per_side is not None and len(self.windows_per_side) not in (1, n):
                raise _fail(
                    "length",
                    f"windows_per_side has {len(self.windows_per_side)} entries for {n} relative layers; give 1 or {n}",
                    ("windows_per_side",),
                )
        else:
            _instantiate(Scheduler, PolicySpec(name=self.name, params=self.params or {}))  # type: ignore[arg-type]
        return self

    @property
    def form(self) -> str:
        """``"layers"``, ``"kept_fraction"`` or ``"name"``."""
        return next(f for f in self.FORMS if getattr(self, f) is not None)

    def max_stages(self) -> int | None:
        """How many stages the schedule has at most (None for a registered scheduler)."""
        if self.layers is not None:
            return len(self.layers)
        if self.kept_fraction is not None:
            return len(self.relative_layers or _KF_DEFAULT.relative_layers)
        return None

    def build(self) -> Scheduler:
        """The `Scheduler` this schedule describes."""
        if self.layers is not None:
            return ExplicitSchedule(
                layers=tuple(self.layers),
                ratios=tuple(float(r) for r in self.ratios or ()),
                windows_per_side=None if self.windows_per_side is None else tuple(self.windows_per_side),
                window_size=None if self.window_size is None else tuple(tuple(s) for s in self.window_size),
            )
        if self.kept_fraction is not None:
            rel = tuple(self.relative_layers) if self.relative_layers is not None else _KF_DEFAULT.relative_layers
            if self.windows_per_side is None:
                wps = _kf_default_windows(self.relative_layers is None, len(rel))
            else:
                wps = tuple(self.windows_per_side)
                wps = wps * len(rel) if len(wps) == 1 else wps
            return KeptFractionSchedule(
                target=float(self.kept_fraction), relative_layers=tuple(float(f) for f in rel), windows_per_side=wps
            )
        return _instantiate(Scheduler, PolicySpec(name=self.name, params=self.params or {}))  # type: ignore[return-value]

    @classmethod
    def from_scheduler(cls, scheduler: Scheduler) -> ScheduleConfig:
        """The schedule config of a scheduler object."""
        if type(scheduler) is ExplicitSchedule:
            s = scheduler
            return cls.model_validate({
                "layers": list(s.layers),
                "ratios": [float(r) for r in s.ratios],
                "windows_per_side": None if s.windows_per_side is None else list(s.windows_per_side),
                "window_size": None if s.window_size is None else [list(w) for w in s.window_size],
            })
        if type(scheduler) is KeptFractionSchedule and scheduler.max_ratio == KeptFractionSchedule.max_ratio:
            s = scheduler
            rel_default = tuple(s.relative_layers) == tuple(_KF_DEFAULT.relative_layers)
            wps = tuple(s.windows_per_side)
            return cls.model_validate({
                "kept_fraction": float(s.target),
                "relative_layers": None if rel_default else [float(f) for f in s.relative_layers],
                "windows_per_side": None if wps == _kf_default_windows(rel_default, len(s.relative_layers)) else list(wps),
            })
        spec = _spec_of(scheduler, "schedule")
        return cls(name=spec.name, params=spec.params or None)

    def to_yaml_value(self) -> dict[str, Any]:
        out = self.model_dump(mode="json", exclude_none=True)
        return out


# ---------------------------------------------------------------------------- pipeline
class PipelineConfig(BaseModel):
    """A whole pipeline: description, schedule and the policies of every stage.

    Every stage uses the top-level policies unless ``stage_overrides`` replaces some of
    them for one stage (by 0-based stage index). ``scorer: null`` means no edge scorer
    (pure pruning).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field("custom", description="A label (preset name) for reports.")
    summary: str = Field("", description="One line for `lightkv presets`.")
    description: str = Field("", description="One paragraph: what the pipeline does and why.")
    source: str = Field("", description="The paper or code the pipeline reproduces.")
    schedule: ScheduleConfig = Field(
        default_factory=lambda: ScheduleConfig(layers=[12, 18, 24], ratios=[0.5], windows_per_side=[4, 2, 1]),
        description="Where to compress, with which windows and ratios.",
    )
    partitioner: PolicySpec = Field(default_factory=lambda: PolicySpec(name="grid"))
    scorer: PolicySpec | None = Field(default_factory=lambda: PolicySpec(name="cosine"))
    pruner: PolicySpec = Field(default_factory=lambda: PolicySpec(name="divergence"))
    passer: PolicySpec = Field(default_factory=lambda: PolicySpec(name="relevance_mean"))
    relevance: PolicySpec = Field(default_factory=lambda: PolicySpec(name="query_softmax"))
    stage_overrides: dict[int, dict[StageField, PolicySpec | None]] = Field(
        default_factory=dict, description="Per-stage replacements: {stage index: {field: policy}}."
    )
    layout: Literal["native", "reference"] = Field(
        "native",
        description="How an adapter lays out the vision tokens: 'native' (lightkv: every grid on its own, "
        "structural tokens protected) or 'reference' (the authors' code: on LLaVA-NeXT the whole anyres "
        "sequence of an image, base grid, high-resolution grid and row newlines, is one span).",
    )

    @field_validator("summary")
    @classmethod
    def _one_line(cls, summary: str) -> str:
        if "\n" in summary.strip():
            raise _fail("summary", "the summary is one line (put the details in description)")
        return summary

    @field_validator("partitioner", "scorer", "pruner", "passer", "relevance")
    @classmethod
    def _known_policy(cls, spec: PolicySpec | None, info) -> PolicySpec | None:
        if spec is None:  # only scorer is Optional; pydantic rejects None for the others
            return None
        params = _coerce_params(FAMILIES[info.field_name], spec)
        _instantiate(FAMILIES[info.field_name], spec)
        return PolicySpec(name=spec.name, params=_canonical_params(spec.params, params))

    @field_validator("stage_overrides")
    @classmethod
    def _known_overrides(cls, overrides: dict[int, dict[str, PolicySpec | None]]) -> dict:
        out: dict[int, dict[str, PolicySpec | None]] = {}
        for index in sorted(overrides):
            if index < 0:
                raise _fail("stage_index", f"stage indices are 0-based and must be >= 0, got {index}", (index,))
            fields = {}
            for field in STAGE_FIELDS:  # canonical order
                if field not in overrides[index]:
                    continue
                spec = overrides[index][field]
                if spec is None:
                    if field != "scorer":
                        raise _fail("required", f"only scorer may be null, not {field}", (index, field))
                    fields[field] = None
                    continue
                try:
                    params = _coerce_params(FAMILIES[field], spec)
                    _instantiate(FAMILIES[field], spec)
                except PydanticCustomError as e:
                    ctx = e.context or {}
                    raise _fail(e.type.removeprefix("lightkv_"), ctx.get("message", e.message()),
                                (index, field) + tuple(ctx.get("subloc", ()))) from None
                fields[field] = PolicySpec(name=spec.name, params=_canonical_params(spec.params, params))
            out[index] = fields
        return out

    @model_validator(mode="after")
    def _check_composition(self) -> PipelineConfig:
        limit = self.schedule.max_stages()
        for index in self.stage_overrides:
            if limit is not None and index >= limit:
                raise _fail(
                    "stage_index",
                    f"stage index {index} is beyond the schedule, which has {limit} stage(s) (indices 0..{limit - 1})",
                    ("stage_overrides", index),
                )
        base = self._policies()
        indices = [None] + sorted(self.stage_overrides)
        for index in indices:
            policies = dict(base)
            if index is not None:
                policies.update({f: None if s is None else _instantiate(FAMILIES[f], s)
                                 for f, s in self.stage_overrides[index].items()})
            try:
                Stage(spec=StageSpec(0, 0.0, windows_per_side=1), **policies)
            except ValueError as e:
                where = ("scorer",) if index is None else ("stage_overrides", index)
                raise _fail("composition", str(e), where) from None
        return self

    # ------------------------------------------------------------------ building
    def _policies(self) -> dict[str, Policy | None]:
        return {
            f: None if getattr(self, f) is None else _instantiate(FAMILIES[f], getattr(self, f))
            for f in STAGE_FIELDS
        }

    def build(self) -> Pipeline:
        """A fresh `lightkv.Pipeline` (new policy objects on every call).

        Raises:
            ConfigError: the config was edited into an invalid state after loading
                (fields are checked again here).
        """
        cfg = type(self).from_dict(self.model_dump())
        overrides = {
            i: {f: None if s is None else _instantiate(FAMILIES[f], s) for f, s in fields.items()}
            for i, fields in cfg.stage_overrides.items()
        }
        return Pipeline(
            scheduler=cfg.schedule.build(),
            stage_overrides=overrides,
            name=cfg.name,
            layout=cfg.layout,
            **cfg._policies(),  # type: ignore[arg-type]
        )

    def validate_for_model(self, num_layers: int) -> list[StageSpec]:
        """Check the schedule against a decoder of ``num_layers`` layers.

        Returns:
            the stages the pipeline runs on such a model.

        Raises:
            ConfigError: a layer at or beyond the model's depth (the message gives the
                depth), or a stage override for a stage the model does not get.
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigError([("num_layers", f"the model depth must be a positive integer, got {num_layers!r}")])
        try:
            stages = self.schedule.build().plan(num_layers)
        except ValueError as e:
            loc = "schedule.layers" if self.schedule.layers is not None else "schedule"
            raise ConfigError([(loc, str(e))]) from None
        for index in self.stage_overrides:
            if index >= len(stages):
                msg = (
                    f"stage {index} does not exist: on a model with {num_layers} layers the schedule has "
                    f"{len(stages)} stage(s)"
                )
                raise ConfigError([(f"stage_overrides.{index}", msg)])
        return stages

    def average_kept_fraction(self, num_layers: int) -> float:
        """Vision-KV fraction kept, averaged over the layers of a ``num_layers`` model
        (ignoring rounding)."""
        return average_kept_fraction(self.validate_for_model(num_layers), num_layers)

    @classmethod
    def from_pipeline(cls, pipeline: Pipeline, **info: str) -> PipelineConfig:
        """The config of a pipeline object (see `config_from_pipeline`)."""
        return config_from_pipeline(pipeline, **info)

    # ------------------------------------------------------------------ plain data
    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> PipelineConfig:
        """Validate plain data (as loaded from YAML or JSON).

        Raises:
            ConfigError: what is wrong, field by field.
        """
        if not isinstance(data, dict):
            kind = "an empty document" if data is None else f"a {type(data).__name__}"
            raise ConfigError([("", f"a pipeline config must be a mapping of fields, got {kind}")], source)
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = _from_validation_error(e)
            raise (err.with_source(source) if source else err) from None

    def to_dict(self) -> dict[str, Any]:
        """Canonical plain data: empty text fields and overrides left out, policies
        without parameters as bare names."""
        out: dict[str, Any] = {"name": self.name}
        for f in ("summary", "description", "source"):
            if getattr(self, f):
                out[f] = getattr(self, f)
        out["schedule"] = self.schedule.to_yaml_value()
        for f in STAGE_FIELDS:
            spec = getattr(self, f)
            out[f] = None if spec is None else spec.to_yaml_value()
        if self.stage_overrides:
            out["stage_overrides"] = {
                i: {f: None if s is None else s.to_yaml_value() for f, s in fields.items()}
                for i, fields in self.stage_overrides.items()
            }
        if self.layout != "native":
            out["layout"] = self.layout
        return out

    # ------------------------------------------------------------------ YAML
    @classmethod
    def from_yaml_text(cls, text: str, source: str | None = None) -> PipelineConfig:
        """Parse and validate YAML text.

        Raises:
            ConfigError: invalid YAML (with line and column) or an invalid config.
        """
        return cls.from_dict(_load_yaml(text, source), source)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> PipelineConfig:
        """Read and validate a YAML file.

        Raises:
            FileNotFoundError: no such file, or a directory.
            ConfigError: too large, invalid YAML or an invalid config.
        """
        return cls.from_yaml_text(read_config_text(path), "<stdin>" if os.fspath(path) == "-" else str(path))

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """The canonical YAML text (``from_yaml_text(to_yaml())`` gives an equal config);
        also written to ``path`` if given."""
        text = yaml.dump(self.to_dict(), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=88)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text


def _canonical_params(given: dict[str, Any], coerced: dict[str, Any]) -> dict[str, Any]:
    """Parameters as stored in a config: the coerced values (so ``"1e-12"`` becomes a float)
    as plain data, in the order given."""
    return {k: _plain(coerced.get(k, v), k) for k, v in given.items()}


# ---------------------------------------------------------------------------- YAML I/O
MAX_CONFIG_BYTES = 64 * 1024
"""Largest pipeline file read (a preset is about 1.5 KB)."""
MAX_YAML_NODES = 10_000
"""Most YAML nodes a document may hold once its aliases are expanded."""
MAX_YAML_DEPTH = 32
"""Deepest nesting of YAML collections accepted."""


def read_config_text(path: str | os.PathLike) -> str:
    """The text of a config file (``-``: standard input), at most `MAX_CONFIG_BYTES`.

    Raises:
        FileNotFoundError: no such file, or a directory (the message says which).
        ConfigError: too large, or not UTF-8 text.
    """
    name = os.fspath(path)
    if name == "-":
        return _read_capped(sys.stdin.buffer, "<stdin>")
    try:
        info = os.stat(name)
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: does not exist") from None
    except NotADirectoryError:
        raise FileNotFoundError(f"{name}: does not exist (a part of the path is not a directory)") from None
    if stat.S_ISDIR(info.st_mode):
        raise FileNotFoundError(f"{name}: is a directory, not a file")
    if stat.S_ISREG(info.st_mode) and info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError([("", f"the file is {info.st_size:,} bytes; a pipeline config is at most "
                                f"{MAX_CONFIG_BYTES // 1024} KiB")], name)
    if stat.S_ISFIFO(info.st_mode):
        # Opening a FIFO blocks until a writer appears: open without blocking, then read;
        # with no writer the read ends at once (an empty document), never hangs.
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            return _read_capped(f, name)
    with open(name, "rb") as f:  # regular files and devices such as /dev/null
        return _read_capped(f, name)


def _read_capped(stream, name: str) -> str:
    data = stream.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError([("", f"more than {MAX_CONFIG_BYTES // 1024} KiB of input; a pipeline config is "
                                f"at most {MAX_CONFIG_BYTES // 1024} KiB")], name)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([("", f"not UTF-8 text (byte {e.start}); a pipeline config is a YAML text file")], name) from None


_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when available: 20x faster


class _Loader(_Base):  # type: ignore[misc, valid-type]
    """Safe loader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _check_events(text: str) -> str | None:
    """What makes ``text`` too costly to load (None if nothing): nesting deeper than
    `MAX_YAML_DEPTH`, more than `MAX_YAML_NODES` nodes once aliases are expanded (a
    'billion laughs' document), or a recursive alias. One pass over the parser's events,
    without building anything."""
    sizes: dict[str, int] = {}
    open_anchors: list[str | None] = []
    counts = [0]
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in open_anchors:
                return f"the alias *{event.anchor} refers to a collection that contains it (a recursive document)"
            counts[-1] += sizes.get(event.anchor, 1)
        elif isinstance(event, yaml.ScalarEvent):
            counts[-1] += 1
            if event.anchor:
                sizes[event.anchor] = 1
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            open_anchors.append(event.anchor)
            counts.append(1)
            if len(counts) - 1 > MAX_YAML_DEPTH:
                return f"collections nested more than {MAX_YAML_DEPTH} deep; a pipeline config needs a few levels"
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            size = counts.pop()
            anchor = open_anchors.pop()
            if anchor:
                sizes[anchor] = size
            counts[-1] += size
        if counts[-1] > MAX_YAML_NODES or sum(counts) > MAX_YAML_NODES:
            return (f"more than {MAX_YAML_NODES:,} values once aliases (*name) are expanded; "
                    "a pipeline config has a few dozen")
    return None


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a mapping key must be a plain value, got {_short(key)}", key_node.start_mark
            ) from None
        if key in out:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {_short(key)} (line {mark.line + 1}, column {mark.column + 1})", mark
            )
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(text: str, source: str | None) -> Any:
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError([("", f"the text is {len(text):,} characters; a pipeline config is at most "
                                f"{MAX_CONFIG_BYTES // 1024} KiB")], source)
    try:
        problem = _check_events(text)
        if problem:
            raise ConfigError([("", f"refused: {problem}")], source)
        return yaml.load(text, Loader=_Loader)
    except RecursionError:
        raise ConfigError([("", "not valid YAML: nested too deeply")], source) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = e.problem or e.context or "invalid YAML"
        raise ConfigError([("", f"not valid YAML: {where}{problem}")], source) from None
    except yaml.YAMLError as e:
        raise ConfigError([("", f"not valid YAML: {e}")], source) from None


class _Dumper(yaml.SafeDumper):
    """Readable canonical YAML: lists of scalars in flow style, long text folded."""


def _represent_str(dumper: _Dumper, value: str) -> yaml.ScalarNode:
    if "\n" in value.rstrip("\n"):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    if len(value) > 80:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=">")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


def _represent_list(dumper: _Dumper, value: list) -> yaml.SequenceNode:
    flow = all(isinstance(v, (int, float, bool, type(None))) or (isinstance(v, str) and len(v) < 40)
               or (isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v)) for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flow)


def _represent_dict(dumper: _Dumper, value: dict) -> yaml.MappingNode:
    # small parameter mappings read best inline: {scope: row, split: all_src}
    flow = bool(value) and len(value) <= 4 and all(
        isinstance(k, str) and isinstance(v, (int, float, bool, type(None), str)) and len(str(v)) < 30
        for k, v in value.items()
    ) and "name" not in value and "layers" not in value and "kept_fraction" not in value
    return dumper.represent_mapping("tag:yaml.org,2002:map", value.items(), flow_style=flow)


_Dumper.add_representer(str, _represent_str)
_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(tuple, _represent_list)
_Dumper.add_representer(dict, _represent_dict)


# ---------------------------------------------------------------------------- helpers
def config_from_pipeline(pipeline: Pipeline, *, summary: str = "", description: str = "", source: str = "") -> PipelineConfig:
    """The `PipelineConfig` of a pipeline object.

    Every policy must be registered; parameters equal to a policy's defaults are left out,
    so ``config_from_pipeline(cfg.build())`` equals ``cfg`` up to the text fields.

    Raises:
        ConfigError: a policy or scheduler that is not registered under a name.
    """
    try:
        schedule = ScheduleConfig.from_scheduler(pipeline.scheduler)
    except ValidationError as e:
        raise ConfigError([(f"schedule.{p}" if p else "schedule", m) for p, m in _from_validation_error(e).problems]) from None
    data: dict[str, Any] = {
        "name": pipeline.name,
        "summary": summary,
        "description": description,
        "source": source,
        "schedule": schedule,
    }
    for f in STAGE_FIELDS:
        policy = getattr(pipeline, f)
        data[f] = None if policy is None else _spec_of(policy, f)
    data["stage_overrides"] = {
        i: {f: None if p is None else _spec_of(p, f"stage_overrides.{i}.{f}") for f, p in fields.items()}
        for i, fields in pipeline.stage_overrides.items()
    }
    data["layout"] = pipeline.layout
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise _from_validation_error(e) from None


def pipeline_from_yaml(path: str | os.PathLike) -> Pipeline:
    """``Pipeline.from_yaml``: read, validate and build a YAML pipeline file."""
    return PipelineConfig.from_yaml(path).build()


def pipeline_to_yaml(pipeline: Pipeline, path: str | os.PathLike | None = None) -> str:
    """``Pipeline.to_yaml``: the canonical YAML of a pipeline object."""
    return config_from_pipeline(pipeline).to_yaml(path)


def load_config(name_or_path: str | os.PathLike) -> PipelineConfig:
    """A preset by name, or a YAML file by path.

    A string that names an existing path other than a directory, or ends in ``.yaml``/``.yml``, or contains a path
    separator, is read as a file (``-`` reads standard input); anything else must be a
    preset name. Files are read through `read_config_text`: at most `MAX_CONFIG_BYTES`,
    and documents that nest too deeply or expand aliases too far are refused at once.

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: an unknown preset (the message lists the presets).
        ConfigError: an invalid file.
    """
    from .presets import PRESETS

    text = os.fspath(name_or_path)
    looks_like_path = (
        text == "-" or (Path(text).exists() and not Path(text).is_dir()) or text.endswith((".yaml", ".yml")) or os.sep in text or "/" in text
    )
    if not looks_like_path:
        if text in PRESETS:
            return PRESETS[text].config.model_copy(deep=True)
        raise ValueError(
            f"no preset or file named {text!r}{_did_you_mean(text, PRESETS)}; presets: {', '.join(PRESETS)}"
        )
    return PipelineConfig.from_yaml(text)


# ---------------------------------------------------------------------------- JSON Schema
def _family_schema(field: str) -> dict[str, Any]:
    family = FAMILIES[field]
    variants = []
    for name, impl in family.registered().items():
        adapter = _adapter(impl)
        params: dict[str, Any] = {"type": "object"}
        if adapter is not None:
            try:
                params = adapter.json_schema()
            except Exception:  # noqa: BLE001  (exotic third-party field types)
                params = {"type": "object"}
            params.pop("title", None)
            params.pop("description", None)
            params["additionalProperties"] = False
        doc = (impl.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        variants.append({
            "type": "object",
            "title": name,
            "description": doc,
            "properties": {"name": {"const": name}, "params": params},
            "required": ["name"],
            "additionalProperties": False,
        })
    names = list(family.registered())
    return {
        "title": f"{family.__name__}Spec",
        "description": f"A registered {family.family}: its bare name, or {{name, params}}.",
        "anyOf": [{"type": "string", "enum": names}, {"oneOf": variants}],
    }


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a pipeline config file.

    Policy fields list the registered names of their family (including third-party
    policies loaded so far) and each policy's parameters with their types.
    """
    schema = PipelineConfig.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "lightkv pipeline"
    defs = schema.setdefault("$defs", {})
    for field in STAGE_FIELDS:
        family_def = _family_schema(field)
        nested_defs = {}
        for variant in family_def["anyOf"][1]["oneOf"]:
            nested_defs.update(variant["properties"]["params"].pop("$defs", {}))
        defs.update(nested_defs)
        defs[family_def["title"]] = family_def
        ref = {"$ref": f"#/$defs/{family_def['title']}"}
        prop = schema["properties"][field]
        description = prop.get("description")
        new = {"anyOf": [ref, {"type": "null"}]} if field == "scorer" else dict(ref)
        if description:
            new["description"] = description
        schema["properties"][field] = new
    schema["properties"]["stage_overrides"] = {
        "description": schema["properties"]["stage_overrides"].get("description", ""),
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                f: ({"anyOf": [{"$ref": f"#/$defs/{FAMILIES[f].__name__}Spec"}, {"type": "null"}]}
                    if f == "scorer" else {"$ref": f"#/$defs/{FAMILIES[f].__name__}Spec"})
                for f in STAGE_FIELDS
            },
        },
    }
    sched = defs.get("ScheduleConfig")
    if sched is not None and "name" in sched.get("properties", {}):
        sched["properties"]["name"] = {
            "anyOf": [{"type": "string", "enum": list(Scheduler.registered())}, {"type": "null"}],
            "default": None,
            "description": sched["properties"]["name"].get("description", ""),
        }
    defs.pop("PolicySpec", None)
    json.dumps(schema)  # must be serialisable
    return schema
