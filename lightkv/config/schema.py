"""The JSON Schema of pipeline files, with every registered policy and its parameters."""

from __future__ import annotations

import json
from typing import Any, cast

from ..policies import FAMILIES, Mode, Policy
from .pipeline import PipelineConfig
from .schedule import ScheduleConfig, shorthands
from .specs import STAGE_FIELDS, _adapter

__all__ = ["json_schema"]


def _family_schema(field: str) -> dict[str, Any]:
    family: type[Policy] = Mode if field == "mode" else FAMILIES[field]
    variants = []
    for name, impl in family.registered().items():
        if family is Mode and not cast("type[Mode]", impl).own:  # a Mode: Mode's registry
            continue
        # mypy checks a class against Hashable through its instances' __hash__; classes hash
        adapter = _adapter(impl)  # type: ignore[arg-type]
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
        variants.append(
            {
                "type": "object",
                "title": name,
                "description": doc,
                "properties": {"name": {"const": name}, "params": params},
                "required": ["name"],
                "additionalProperties": False,
            }
        )
    names = [v["title"] for v in variants]
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
                f: (
                    {"anyOf": [{"$ref": f"#/$defs/{FAMILIES[f].__name__}Spec"}, {"type": "null"}]}
                    if f == "scorer"
                    else {"$ref": f"#/$defs/{FAMILIES[f].__name__}Spec"}
                )
                for f in STAGE_FIELDS
            },
        },
    }
    mode_def = _family_schema("mode")
    for variant in mode_def["anyOf"][1]["oneOf"]:
        defs.update(variant["properties"]["params"].pop("$defs", {}))
    defs[mode_def["title"]] = mode_def
    schema["properties"]["mode"] = {
        "anyOf": [{"$ref": f"#/$defs/{mode_def['title']}"}, {"type": "null"}],
        "description": schema["properties"]["mode"].get("description", ""),
    }
    schedule_def = _schedule_schema()
    for variant in schedule_def["anyOf"][-1]["oneOf"]:
        defs.update(variant["properties"]["params"].pop("$defs", {}))
    defs["ScheduleConfig"] = schedule_def
    defs.pop("PolicySpec", None)
    json.dumps(schema)  # must be serialisable
    return schema


def _schedule_schema() -> dict[str, Any]:
    """The schedule: every registered scheduler's shorthand (`Scheduler.shorthand_schema`),
    or any registered scheduler as its bare name or ``{name, params}``."""
    short = [impl.shorthand_schema() for _, impl in shorthands().values()]
    family = _family_schema("scheduler")
    return {
        "title": "ScheduleConfig",
        "description": (ScheduleConfig.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "),
        "anyOf": [*short, *family["anyOf"]],
    }
