"""Checks a pipeline config runs beyond its fields' types: a policy spec built once in
canonical form, the pipeline's own mode, a pipeline that plans no stage, and stages placed
where their relevance cannot be computed."""

from __future__ import annotations

from typing import Any, cast

from ..policies import Mode
from ..stage import placement_problem
from .errors import ConfigError, _fail
from .specs import STAGE_FIELDS, PolicySpec, _build, _canonical

__all__ = [
    "KNOB",
    "check_no_stages",
    "check_stages",
    "mode_without_schedule",
    "planned_stages",
    "validated",
    "validated_mode",
]

KNOB = (
    "The method at this vision-KV fraction in (0, 1], averaged over layers, on any depth (null: "
    "the schedule as written); a fraction it cannot reach on a model is an error naming the "
    "nearest reachable one."
)
"""The description of a pipeline file's ``kept_fraction`` (`lightkv.Pipeline.kept_fraction`)."""


def validated(family, spec: PolicySpec) -> PolicySpec:
    """``spec`` in canonical form, holding the policy it names, constructed once."""
    policy, params = _build(family, spec)
    return PolicySpec(
        name=spec.name, params=_canonical(family, policy, spec.name, params)
    )._remember(policy)


def mode_without_schedule(data: Any) -> Any:
    """Plain data before validation: a ``mode:`` block without ``schedule:`` is a pipeline
    of the mode alone (``schedule: null``); the old ``h2o`` schedule is refused, naming the
    mode that replaced it."""
    if not isinstance(data, dict):
        return data
    old = data.get("schedule")
    if old == "h2o" or (isinstance(old, dict) and old.get("name") == "h2o"):
        params = old.get("params") if isinstance(old, dict) else None
        flow = ", ".join(f"{k}: {v}" for k, v in (params or {}).items())
        raise _fail(
            "removed_param",
            "the h2o schedule is now the h2o mode (it plans no stage): write "
            f"`mode: {{name: h2o, params: {{{flow}}}}}` and no schedule",
            ("schedule",),
        )
    if data.get("mode") is not None and "schedule" not in data:
        data = {**data, "schedule": None}
    return data


def validated_mode(spec: PolicySpec) -> PolicySpec:
    """The pipeline's own mode, validated; a mode that runs stages or always runs is
    refused (a pipeline cannot hold it as its own)."""
    spec = validated(Mode, spec)
    if not type(cast(Mode, spec.built())).own:  # validated as a Mode just above
        raise _fail(
            "not_own_mode",
            f"mode {spec.name!r} runs the stages that name it or whenever a session needs "
            "it, so a pipeline cannot hold it as its own: choose the place of stages with "
            "the schedule (or placement), and give `mode:` only for modes such as h2o",
            ("name",),
        )
    return spec


def check_no_stages(cfg: Any) -> None:
    """Without a schedule nothing but the mode runs: refuse a config without a mode, and
    policies (or a placement) given with other values than the defaults, which would
    silently not run (the defaults come back when a whole dump is validated again)."""
    if cfg.mode is None:
        raise _fail(
            "no_work",
            "schedule is null and no mode is given, so the pipeline would do nothing: give "
            "a schedule (its stages) or a mode (e.g. mode: {name: h2o})",
            ("schedule",),
        )
    fields = type(cfg).model_fields
    idle = [
        f
        for f in (*STAGE_FIELDS, "stage_overrides", "placement")
        if f in cfg.model_fields_set
        and getattr(cfg, f) != fields[f].get_default(call_default_factory=True)
    ]
    if idle:
        raise _fail(
            "unused_policy",
            f"the pipeline plans no stage (no schedule), so {idle[0]!r} would never run: "
            "remove it, or give a schedule whose stages use it",
            (idle[0],),
        )


def planned_stages(cfg: Any, num_layers: int) -> list[Any]:
    """The stages ``cfg``'s schedule plans on ``num_layers`` layers, before its placement
    moves them: at ``cfg.kept_fraction`` when set (the built pipeline resolves it); the
    pipeline's own mode checked against the depth ([] without a schedule).

    Raises:
        ConfigError: located at ``kept_fraction`` (a target out of reach), ``mode`` or the
            schedule (stages that do not fit the depth).
    """
    knob = cfg.kept_fraction is not None
    pipe = cfg.build() if knob else None
    try:
        mode = pipe.mode_at(num_layers) if pipe else cfg.mode and cfg.mode.built()
        if mode is not None:
            mode.check_depth(num_layers)
    except ValueError as e:
        raise ConfigError([("kept_fraction" if knob else "mode", str(e))]) from None
    if cfg.schedule is None:
        return []
    try:
        scheduler = pipe.scheduler_at(num_layers) if pipe else cfg.schedule._scheduler()
        return scheduler.plan(num_layers)
    except ValueError as e:
        loc = "schedule.layers" if cfg.schedule.name == "explicit" else "schedule"
        raise ConfigError([("kept_fraction" if knob else loc, str(e))]) from None


def check_stages(cfg: Any, stages: list, num_layers: int) -> None:
    """Check the stages ``cfg`` plans on a ``num_layers`` decoder: every stage override
    names one of them, and no stage's relevance is placed where it cannot be computed (a
    stage on a layer's cache whose relevance reads the vision tower or the hidden states),
    refused with the message `lightkv.apply` gives (`lightkv.stage.placement_problem`).

    Raises:
        ConfigError: an override beyond the stages; a misplaced relevance, located at
            ``placement`` when the placement moved the stage there, else at the relevance.
    """
    for index in cfg.stage_overrides:
        if index >= len(stages):
            msg = (
                f"stage {index} does not exist: on a model with {num_layers} layers the "
                f"schedule has {len(stages)} stage(s)"
            )
            raise ConfigError([(f"stage_overrides.{index}", msg)])
    for i, spec in enumerate(stages):
        override = cfg.stage_overrides.get(i, {})
        relevance = override["relevance"] if "relevance" in override else cfg.relevance
        problem = placement_problem(spec, relevance.built())
        if problem is not None:
            where = (
                "placement"
                if cfg.placement != "planned"
                else f"stage_overrides.{i}.relevance"
                if "relevance" in override
                else "relevance"
            )
            raise ConfigError([(where, problem)])
