"""Conversions between pipeline objects, configs and files: `config_from_pipeline`,
`pipeline_from_yaml`, `pipeline_to_yaml`."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from pydantic import ValidationError

from ..pipeline import Pipeline
from .errors import ConfigError
from .pipeline import PipelineConfig, _from_validation_error
from .schedule import ScheduleConfig
from .specs import STAGE_FIELDS, _spec_of

__all__ = ["config_from_pipeline", "pipeline_from_yaml", "pipeline_to_yaml"]


def config_from_pipeline(
    pipeline: Pipeline,
    *,
    summary: str | None = None,
    description: str | None = None,
    source: str | None = None,
) -> PipelineConfig:
    """The `PipelineConfig` of a pipeline object.

    Every policy must be registered; parameters equal to a policy's defaults are left out,
    so ``config_from_pipeline(cfg.build())`` equals ``cfg``. The text fields are the
    pipeline's unless given.

    Raises:
        ConfigError: a policy or scheduler that is not registered under a name.
    """
    try:
        schedule = (
            None
            if pipeline.scheduler is None
            else ScheduleConfig.from_scheduler(pipeline.scheduler)
        )
    except ValidationError as e:
        raise ConfigError(
            [
                (f"schedule.{p}" if p else "schedule", m)
                for p, m in _from_validation_error(e).problems
            ]
        ) from None
    data: dict[str, Any] = {
        "name": pipeline.name,
        "summary": pipeline.summary if summary is None else summary,
        "description": pipeline.description if description is None else description,
        "source": pipeline.source if source is None else source,
        "schedule": schedule,
        "layout": pipeline.layout,
        "placement": pipeline.placement,
        "proportional_attention": pipeline.proportional_attention,
        "divergence_memory_mib": pipeline.divergence_memory_mib,
        "released_quirks": dataclasses.asdict(pipeline.released_quirks),
        "kept_fraction": pipeline.kept_fraction,
    }
    if pipeline.mode is not None:
        data["mode"] = _spec_of(pipeline.mode, "mode")
    if schedule is None:  # no stage: the policies never run, so the config lists none
        return _validate(data)
    for f in STAGE_FIELDS:
        policy = getattr(pipeline, f)
        data[f] = None if policy is None else _spec_of(policy, f)
    data["stage_overrides"] = {
        i: {
            f: None if p is None else _spec_of(p, f"stage_overrides.{i}.{f}")
            for f, p in fields.items()
        }
        for i, fields in pipeline.stage_overrides.items()
    }
    return _validate(data)


def _validate(data: dict[str, Any]) -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise _from_validation_error(e) from None


def pipeline_from_yaml(path: str | os.PathLike) -> Pipeline:
    """Read, validate and build a YAML pipeline file."""
    return PipelineConfig.from_yaml(path).build()


def pipeline_to_yaml(pipeline: Pipeline, path: str | os.PathLike | None = None) -> str:
    """The canonical YAML of a pipeline object (also written to ``path`` if given)."""
    return config_from_pipeline(pipeline).to_yaml(path)
