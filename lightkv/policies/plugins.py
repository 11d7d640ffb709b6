"""Loading third-party policies from the ``lightkv.policies`` entry-point group.

Each entry point is loaded on its own, at most once per process, and only when a lookup
misses: the entry point of the same name first, then the others. A broken plugin never
hides a healthy one: its exception is recorded and named by the "unknown policy" error,
or raised (with the plugin's name) when its own name is asked for.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

__all__ = ["ENTRY_POINT_GROUP", "EntryPointStatus", "PluginError", "load_entry_points"]

ENTRY_POINT_GROUP = "lightkv.policies"


class PluginError(ValueError):
    """A plugin's entry point failed to load or does not register what it names."""


@dataclass(frozen=True)
class EntryPointStatus:
    """What loading one entry point did.

    Attributes:
        name: the entry point's name (``name = "package.module:Class"``).
        value: its target, ``"package.module:Class"``.
        error: why it failed (``"ModuleNotFoundError: No module named 'x'"``), None if it loaded.
    """

    name: str
    value: str
    error: str | None = None

    def describe(self) -> str:
        return f"{self.name} = {self.value} ({self.error})"


_scans: dict[str, tuple[tuple, list[Any]]] = {}
"""The last scan of the installed distributions' entry points per group, with the sys.path
it saw."""


def _path_state() -> tuple:
    """Each sys.path entry with its modification time: installing a distribution adds a
    ``*.dist-info`` folder to one of them, which changes that folder's time."""
    state: list[tuple[str, int | None]] = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, None))
    return tuple(state)


def _entry_points(group: str = ENTRY_POINT_GROUP) -> list[Any]:
    # scanning every distribution's metadata costs ~7 ms, and validation asks for the
    # registry once per policy (about 170 times while the presets load): scan again only
    # when sys.path or one of its folders changed
    state = _path_state()
    scan = _scans.get(group)
    if scan is None or scan[0] != state:
        eps = sorted(metadata.entry_points(group=group), key=lambda ep: (ep.name, ep.value))
        scan = _scans[group] = (state, eps)
    return scan[1]


def _check_loaded(obj: Any, ep: Any, policy_base: type) -> str | None:
    """Register an undecorated policy class under the entry-point name (with a warning);
    warn when the class is registered under another name. Returns an error or None."""
    if not isinstance(obj, type):
        return None  # a module: importing it ran its @register decorators
    if not issubclass(obj, policy_base):
        return f"{obj.__qualname__} is not a lightkv policy (subclass a family such as EdgeScorer)"
    # a Policy family (its base class; typed loosely: `Policy` imports this module)
    family: Any = next((c for c in obj.__mro__ if "_registry" in c.__dict__), None)
    if family is None or family is policy_base:
        return f"{obj.__qualname__} does not belong to a policy family"
    registered = [n for n, impl in family._registry.items() if impl is obj]
    if not registered:
        warnings.warn(
            f"lightkv plugin {ep.name} = {ep.value}: {obj.__qualname__} is not decorated with "
            f"@{family.__name__}.register(...); registered it as {family.family} {ep.name!r}",
            stacklevel=4,
        )
        family.register(ep.name)(obj)
    elif ep.name not in registered:
        warnings.warn(
            f"lightkv plugin {ep.name} = {ep.value} registers {obj.__qualname__} as "
            f"{family.family} {registered[0]!r}, not {ep.name!r}: configurations must say "
            f"{registered[0]!r}",
            stacklevel=4,
        )
    return None


def load_entry_points(
    status: dict[str, EntryPointStatus],
    policy_base: type,
    first: str | None = None,
    done: Callable[[], bool] = lambda: False,
    group: str = ENTRY_POINT_GROUP,
) -> None:
    """Load ``group``'s entry points not yet in ``status``, each on its own, the one named
    ``first`` before the others, until ``done()``; record what happened in ``status``."""
    eps = [ep for ep in _entry_points(group) if f"{ep.name}={ep.value}" not in status]
    eps.sort(key=lambda ep: ep.name != first)
    for ep in eps:
        key = f"{ep.name}={ep.value}"
        try:
            error = _check_loaded(ep.load(), ep, policy_base)
        except Exception as exc:  # a plugin may raise anything on import; report, never hide others
            error = f"{type(exc).__name__}: {exc}"
        status[key] = EntryPointStatus(ep.name, ep.value, error)
        if error is not None:
            warnings.warn(
                f"lightkv plugin {ep.name} = {ep.value} failed to load: {error}", stacklevel=3
            )
        if done():
            return
