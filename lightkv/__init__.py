"""lightkv: make the KV cache of vision-language models lighter.

```python
import lightkv
pipe = lightkv.load("lightkv")                 # a preset name or a YAML file
stage = pipe.stages(num_layers=32)[0]
result = stage(hidden, layout, relevance)      # pure: tensors in, tensors out
with lightkv.apply(pipe, model) as session:    # inside an unmodified transformers model
    model.generate(**inputs)
```

The core (`lightkv.graph`, `lightkv.policies`, `lightkv.pipeline`) needs only torch;
the names that need pydantic/PyYAML (configs, presets) or transformers (`apply`) are
imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .graph import ImageSegment, Provenance, TokenKind, VisionLayout
from .pipeline import Pipeline
from .policies import StageInputs
from .stage import Stage, StageResult

__version__ = "0.1.0"

_LAZY = {
    "ConfigError": "lightkv.config",
    "PipelineConfig": "lightkv.config",
    "PRESETS": "lightkv.presets",
    "get_preset": "lightkv.presets",
    "load_config": "lightkv.presets",
    "load": "lightkv.api",
    "apply": "lightkv.api",
    "to_yaml": "lightkv.api",
}

__all__ = [
    "PRESETS",
    "ConfigError",
    "ImageSegment",
    "Pipeline",
    "PipelineConfig",
    "Provenance",
    "Stage",
    "StageInputs",
    "StageResult",
    "TokenKind",
    "VisionLayout",
    "apply",
    "get_preset",
    "load",
    "load_config",
    "to_yaml",
]


def __getattr__(name: str) -> Any:
    # PEP 562: the config layer (pydantic) and the adapters (transformers) load on first use.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lightkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
