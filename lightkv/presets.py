"""Shipped pipelines, as YAML files beside the methods they run (``lightkv/methods/*.yaml``).

Each preset is a `lightkv.config.PipelineConfig`: LightKV and its per-model schedules, and
the baselines (FastV, ToMe, PyramidDrop, random dropping, spatial pooling, and the cache-level
ElasticCache and H2O) as compositions
of the same policy families. ``lightkv presets`` lists them; ``lightkv config show NAME``
prints one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from . import methods
from .config import ConfigError, PipelineConfig
from .config.errors import _did_you_mean
from .pipeline import Pipeline

__all__ = ["PRESETS", "Preset", "get_preset", "get_preset_config", "is_config_path", "load_config"]

_ORDER = (
    "lightkv",
    "lightkv-qwen2_5_vl",
    "lightkv-paper",
    "lightkv-paper-qwen2_5_vl",
    "lightkv-paper-released",
    "lightkv-paper-released-qwen2_5_vl",
    "lightkv-budget",
    "lightkv-no-relevance",
    "lightkv-video",
    "lightkv-video-paper",
    "lightkv-pre-llm",
    "lightkv-low-budget",
    "lightkv-first-layer",
    "lightkv-cover",
    "fastv",
    "pdrop",
    "tome",
    "pool",
    "random",
    "elasticcache",
    "h2o",
    "visionzip",
    "vispruner",
    "divprune",
    "cdpruner",
    "cdpruner-pos",
    "dart",
    "scope",
    "mmtok",
    "holov",
    "vscan",
    "downsample",
)
"""Listing order; any other shipped file follows alphabetically."""


@dataclass(frozen=True)
class Preset:
    """A named pipeline with a one-line summary, a one-paragraph description and its source.

    Attributes:
        name: the preset's name (its file name without ``.yaml``).
        summary: one line, for listings.
        description: one paragraph: what the pipeline does, with its source paper.
        build: makes a fresh `lightkv.Pipeline`.
        source: the paper (and code) the preset follows.
        config: the validated configuration.
    """

    name: str
    summary: str
    description: str
    build: Callable[[], Pipeline]
    source: str = ""
    config: PipelineConfig | None = field(default=None, compare=False, repr=False)


def _load() -> dict[str, Preset]:
    found: dict[str, Preset] = {}
    for entry in resources.files(methods).iterdir():
        if not entry.name.endswith(".yaml"):
            continue
        stem = entry.name[: -len(".yaml")]
        source = f"preset file {entry.name}"
        cfg = PipelineConfig.from_yaml_text(entry.read_text(encoding="utf-8"), source)
        if cfg.name != stem:
            raise ConfigError(
                [("name", f"must match the file name {stem!r}, got {cfg.name!r}")], source
            )
        found[stem] = Preset(cfg.name, cfg.summary, cfg.description, cfg.build, cfg.source, cfg)
    ordered = [n for n in _ORDER if n in found] + sorted(set(found) - set(_ORDER))
    return {n: found[n] for n in ordered}


PRESETS: dict[str, Preset] = _load()
"""Every shipped preset by name, in listing order."""


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}")


def get_preset(name: str) -> Pipeline:
    """A fresh pipeline for preset ``name``.

    Raises:
        ValueError: unknown name (the message lists the presets).
    """
    try:
        return PRESETS[name].build()
    except KeyError:
        raise _unknown(name) from None


def get_preset_config(name: str) -> PipelineConfig:
    """A copy of preset ``name``'s configuration (edit it freely).

    Raises:
        ValueError: unknown name (the message lists the presets).
    """
    try:
        cfg = PRESETS[name].config
    except KeyError:
        raise _unknown(name) from None
    assert cfg is not None
    return cfg.model_copy(deep=True)


def is_config_path(name_or_path: str | os.PathLike) -> bool:
    """Whether `load_config` reads ``name_or_path`` as a file rather than a preset name: an
    existing path (a directory only when it is not also a preset's name; read as a path, it
    is refused as a directory), a name ending in ``.yaml``/``.yml``, one with a path
    separator, or ``-`` (standard input)."""
    text = os.fspath(name_or_path)
    return (
        text == "-"
        or (Path(text).exists() and not (Path(text).is_dir() and text in PRESETS))
        or text.endswith((".yaml", ".yml"))
        or os.sep in text
        or "/" in text
    )


def load_config(name_or_path: str | os.PathLike) -> PipelineConfig:
    """A preset's configuration by name (a copy), or a YAML file's by path (see
    `is_config_path`). Files are read through `lightkv.config.read_config_text`: at most
    `lightkv.config.MAX_CONFIG_BYTES`, and documents that nest too deeply or expand aliases
    too far are refused at once.

    Raises:
        FileNotFoundError: a path that does not exist, or a directory (the message says so).
        ValueError: an unknown preset (the message lists the presets).
        ConfigError: an invalid file.
    """
    text = os.fspath(name_or_path)
    if is_config_path(text):
        return PipelineConfig.from_yaml(text)
    if text in PRESETS:
        return get_preset_config(text)
    raise ValueError(
        f"no preset or file named {text!r}{_did_you_mean(text, PRESETS)}; presets: "
        f"{', '.join(PRESETS)}"
    )
