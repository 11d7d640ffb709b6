"""Declarative pipelines: the pydantic schema, YAML in and out, JSON Schema.

A `PipelineConfig` fully describes a `lightkv.Pipeline`: its schedule and, for each stage,
the policy of each family by registered name with its parameters. It is the single source
of truth for presets (``lightkv/methods/*.yaml``), user files and the JSON Schema.

```yaml
name: my-lightkv
summary: LightKV with L2 edges in the last stage
schedule:
  layers: [12, 18, 24]          # 0-based decoder layers after which a stage runs
  removal_ratios: [0.5]         # removal ratio per stage (one value is broadcast)
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

A schedule is a registered scheduler like any policy, ``{name: ..., params: {...}}``
(``explicit``, ``kept_fraction``, ``scaled``, ``budget`` or your own); ``layers: ...`` above
is the shorthand of ``name: explicit``, and ``kept_fraction: 0.55`` that of ``name:
kept_fraction, params: {kept_fraction: 0.55}`` (see `ScheduleConfig`). Policy names are checked
against the family registries (`lightkv.policies.FAMILIES`), which include third-party
policies registered with a decorator or through the ``lightkv.policies`` entry-point group.

Invalid configurations raise `ConfigError`, whose message names the field, the bad value
and what is allowed.

Modules: `errors` (ConfigError and message helpers), `specs` (policies by name),
`schedule` (the schedule and scheduler shorthands), `pipeline` (PipelineConfig), `convert`
(pipeline objects to configs and files), `yaml_io`
(reading and writing YAML), `schema` (JSON Schema).
"""

from .convert import config_from_pipeline, pipeline_from_yaml, pipeline_to_yaml
from .errors import ConfigError
from .errors import _did_you_mean as _did_you_mean  # suggestions in the same words (used by tests)
from .pipeline import PipelineConfig
from .schedule import ScheduleConfig
from .schema import json_schema
from .specs import STAGE_FIELDS, PolicySpec
from .yaml_io import MAX_CONFIG_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES, read_config_text

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "STAGE_FIELDS",
    "ConfigError",
    "PipelineConfig",
    "PolicySpec",
    "ScheduleConfig",
    "config_from_pipeline",
    "json_schema",
    "pipeline_from_yaml",
    "pipeline_to_yaml",
    "read_config_text",
]
