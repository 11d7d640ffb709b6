"""lightkv: make the KV cache of vision-language models lighter.

```python
import lightkv
pipe = lightkv.Pipeline.from_preset("lightkv")
stage = pipe.stages(num_layers=32)[0]
result = stage(hidden, layout, relevance)   # pure: tensors in, tensors out
```
"""

from .config import ConfigError, PipelineConfig, load_config
from .graph import ImageSegment, Provenance, TokenKind, VisionLayout
from .pipeline import Pipeline, Stage, StageResult
from .presets import PRESETS, get_preset

__version__ = "0.1.0"

__all__ = [
    "PRESETS",
    "ConfigError",
    "ImageSegment",
    "Pipeline",
    "PipelineConfig",
    "Provenance",
    "Stage",
    "StageResult",
    "TokenKind",
    "VisionLayout",
    "get_preset",
    "load_config",
]
