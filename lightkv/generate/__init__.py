"""Generate an answer to one image + prompt with a compressed prefill (``lightkv generate``).

```python
from lightkv.generate import load_model, build_inputs, run
loaded = load_model("path/to/llava-1.5-7b-hf", dtype="bfloat16", device="cuda")
inputs = build_inputs(loaded, "cat.png", "What is in the image?")
result = run(loaded, inputs, lightkv.load("lightkv"), compare=True)
print(result.format())
```

The model and its processor are loaded with transformers' auto classes
(``AutoProcessor`` and ``AutoModelForImageTextToText``, falling back to
``AutoModelForCausalLM`` for families such as Fuyu). Generation is greedy. Times are
wall-clock and come from the same ``generate`` calls: *time to first token* is when the
call hands its first new token to a streamer (vision encoder + prefill + one token),
*generate time* the whole call; each is the median over ``repeats`` calls, after one
untimed warm-up prefill. (Timing them in separate calls once showed 744 ms of generation
below 2,804 ms of TTFT on a loaded machine.)

User errors (a missing file or model, an unsupported family, a processor that cannot build
the prompt) raise `GenerateError` with a one-line message.
"""

from __future__ import annotations

from .errors import GenerateError
from .loading import (
    DTYPES,  # noqa: F401  (a module attribute before the split)
    build_inputs,
    decoder_depth,
    load_image,
    load_model,
)
from .results import GenerateResult, Loaded, Run
from .running import MAX_REPEATS, run

__all__ = [
    "GenerateError",
    "GenerateResult",
    "Loaded",
    "MAX_REPEATS",
    "Run",
    "build_inputs",
    "decoder_depth",
    "load_image",
    "load_model",
    "run",
]
