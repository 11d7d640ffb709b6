"""YAML in and out: `read_config_text` with its size cap, a safe loader that refuses
duplicate keys, deep nesting and alias bombs before building anything, and the dumper of
canonical YAML."""

from __future__ import annotations

import os
import stat
import sys
from typing import Any

import yaml

from .errors import ConfigError, _short

__all__ = ["MAX_CONFIG_BYTES", "MAX_YAML_DEPTH", "MAX_YAML_NODES", "dump_yaml", "read_config_text"]

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
        raise FileNotFoundError(
            f"{name}: does not exist (a part of the path is not a directory)"
        ) from None
    if stat.S_ISDIR(info.st_mode):
        raise FileNotFoundError(
            f"{name}: is a directory, not a file: give a pipeline YAML file in it, or a preset "
            "name (lightkv presets)"
        )
    if stat.S_ISREG(info.st_mode) and info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            [
                (
                    "",
                    (
                        f"the file is {info.st_size:,} bytes; a pipeline config is at most "
                        f"{MAX_CONFIG_BYTES // 1024} KiB"
                    ),
                )
            ],
            name,
        )
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
        raise ConfigError(
            [
                (
                    "",
                    (
                        f"more than {MAX_CONFIG_BYTES // 1024} KiB of input; a pipeline config is "
                        f"at most {MAX_CONFIG_BYTES // 1024} KiB"
                    ),
                )
            ],
            name,
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            [("", f"not UTF-8 text (byte {e.start}); a pipeline config is a YAML text file")], name
        ) from None


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
                return (
                    f"the alias *{event.anchor} refers to a collection that contains it "
                    "(a recursive document)"
                )
            counts[-1] += sizes.get(event.anchor, 1)
        elif isinstance(event, yaml.ScalarEvent):
            counts[-1] += 1
            if event.anchor:
                sizes[event.anchor] = 1
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            open_anchors.append(event.anchor)
            counts.append(1)
            if len(counts) - 1 > MAX_YAML_DEPTH:
                return (
                    f"collections nested more than {MAX_YAML_DEPTH} deep; "
                    "a pipeline config needs a few levels"
                )
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            size = counts.pop()
            anchor = open_anchors.pop()
            if anchor:
                sizes[anchor] = size
            counts[-1] += size
        if counts[-1] > MAX_YAML_NODES or sum(counts) > MAX_YAML_NODES:
            return (
                f"more than {MAX_YAML_NODES:,} values once aliases (*name) are expanded; "
                "a pipeline config has a few dozen"
            )
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
                None,
                None,
                f"a mapping key must be a plain value, got {_short(key)}",
                key_node.start_mark,
            ) from None
        if key in out:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {_short(key)} (line {mark.line + 1}, column {mark.column + 1})",
                mark,
            )
        out[key] = loader.construct_object(value_node, deep=deep)
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(text: str, source: str | None) -> Any:
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(
            [
                (
                    "",
                    (
                        f"the text is {len(text):,} characters; a pipeline config is at most "
                        f"{MAX_CONFIG_BYTES // 1024} KiB"
                    ),
                )
            ],
            source,
        )
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
    flow = all(
        isinstance(v, (int, float, bool, type(None)))
        or (isinstance(v, str) and len(v) < 40)
        or (isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v))
        for v in value
    )
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flow)


def _represent_dict(dumper: _Dumper, value: dict) -> yaml.MappingNode:
    # small parameter mappings read best inline: {scope: row, split: all_src}
    flow = (
        bool(value)
        and len(value) <= 4
        and all(
            isinstance(k, str)
            and isinstance(v, (int, float, bool, type(None), str))
            and len(str(v)) < 30
            for k, v in value.items()
        )
        and "name" not in value
        and "layers" not in value
        and "kept_fraction" not in value
    )
    return dumper.represent_mapping("tag:yaml.org,2002:map", value.items(), flow_style=flow)


_Dumper.add_representer(str, _represent_str)
_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(tuple, _represent_list)
_Dumper.add_representer(dict, _represent_dict)


def dump_yaml(data: Any) -> str:
    """Canonical YAML text of plain config data."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=88)
