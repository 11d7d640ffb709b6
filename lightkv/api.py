"""The facade: load a pipeline, save it, apply it to a model.

These are free functions at the top of the house (they import the config layer, the
presets and the adapters), so `lightkv.pipeline.Pipeline` itself imports nothing above
the policies.

```python
import lightkv
pipe = lightkv.load("lightkv")                # a preset name, or a YAML file's path
text = lightkv.to_yaml(pipe)                  # canonical YAML (also written to a path if given)
with lightkv.apply(pipe, model) as session:   # hooks on this model instance only
    out = model.generate(**inputs, max_new_tokens=32)
print(session.report())
```
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .config import config_from_pipeline
from .pipeline import Pipeline
from .presets import get_preset, is_config_path, load_config

if TYPE_CHECKING:  # the adapters need transformers: imported for the annotation only
    from .adapters.session import CompressionSession

__all__ = ["apply", "load", "to_yaml"]


def load(name_or_path: str | os.PathLike, *, kept_fraction: float | None = None) -> Pipeline:
    """A shipped preset by name, or a YAML pipeline file by path, built.

    See `lightkv.presets.is_config_path` for how a string is read as a name or a path.
    ``kept_fraction`` puts the method at a kept vision-KV fraction in ``(0, 1]`` on whatever
    depth the model has (`lightkv.Pipeline.kept_fraction`, resolved at `apply`; it replaces
    a file's own ``kept_fraction``): FastV stays after its layer with a larger or smaller
    ratio, a pre-LLM method keeps ``kept_fraction`` before the LLM, and a target the method
    cannot reach on the model is a one-line error naming the nearest it can.

    Returns:
        The pipeline: its scheduler and stage compositions, ready for `apply` (or for
        ``pipeline.stages(num_layers)`` to run a stage on tensors directly).

    Examples:
        ```python
        import lightkv

        pipe = lightkv.load("lightkv")           # a shipped preset (`lightkv presets` lists them)
        pipe = lightkv.load("configs/mine.yaml")  # a pipeline file
        stage = pipe.stages(num_layers=32)[0]    # the first stage, a pure function of tensors
        fastv = lightkv.load("fastv", kept_fraction=0.25)  # FastV keeping 25% of the vision KV
        ```

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: an unknown preset (the message lists the presets), or a
            ``kept_fraction`` outside ``(0, 1]``.
        lightkv.config.ConfigError: an invalid file.
    """
    if is_config_path(name_or_path):
        pipe = load_config(name_or_path).build()
    else:
        pipe = get_preset(os.fspath(name_or_path))
    return pipe if kept_fraction is None else pipe.at_kept_fraction(kept_fraction)


def to_yaml(pipeline: Pipeline, path: str | os.PathLike | None = None) -> str:
    """Canonical YAML of ``pipeline`` (also written to ``path`` if given); its policies
    must be registered."""
    return config_from_pipeline(pipeline).to_yaml(path)


def fingerprint(pipeline: Pipeline) -> str:
    """A stable hash of what ``pipeline`` does: SHA-256 (16 hex digits) of its canonical YAML
    (`to_yaml`) without the text about it (name, summary, description, source). Equal for
    pipelines that compress alike, whatever they are called; the vLLM plugin puts it into
    vLLM's cache keys. (A function of the facade, not a ``Pipeline`` method: the canonical
    YAML lives in `lightkv.config`, a layer above `lightkv.pipeline`.)

    Raises:
        lightkv's registry errors: a policy that is not registered (no canonical YAML).
    """
    import dataclasses
    import hashlib

    bare = dataclasses.replace(pipeline, name="", summary="", description="", source="")
    return hashlib.sha256(to_yaml(bare).encode("utf-8")).hexdigest()[:16]


def apply(pipeline: Pipeline | str | os.PathLike, model: Any, **options: Any) -> CompressionSession:
    """Compress ``model``'s prefill with ``pipeline`` inside a ``with`` block.

    ``pipeline`` may also be a preset name or a YAML path (see `load`). Hooks are installed
    on this model instance only and removed on exit (also after an exception). The options
    are those of `lightkv.adapters.apply` (``adapter``, ``record``, family options).

    Returns:
        The session, a context manager: entering it installs the hooks, leaving it removes
        them. Inside and after the block, its ``report()``
        (`lightkv.adapters.session.CompressionSession.report`) says what happened
        (kept vision fraction, per-layer KV lengths and bytes, estimated prefill FLOPs).

    Examples:
        ```python
        import lightkv
        from transformers import AutoModelForImageTextToText, AutoProcessor

        model = AutoModelForImageTextToText.from_pretrained("llava-hf/llava-1.5-7b-hf")
        processor = AutoProcessor.from_pretrained("llava-hf/llava-1.5-7b-hf")
        inputs = processor(images=image, text=prompt, return_tensors="pt")
        # the pipeline: a preset name, a YAML path or a Pipeline
        with lightkv.apply("lightkv", model) as session:
            out = model.generate(**inputs, max_new_tokens=32)
        print(session.report())  # kept fraction, KV bytes, per-layer lengths
        ```

    Raises:
        ValueError: an unknown preset; a model family or attention implementation lightkv
            does not support (the message lists the supported ones); a schedule that does
            not fit the model's depth.
        lightkv.config.ConfigError: an invalid pipeline file.
    """
    from .adapters import apply as apply_to_model  # transformers: only when a model is hooked

    if not isinstance(pipeline, Pipeline):
        pipeline = load(pipeline)
    return apply_to_model(pipeline, model, **options)
