"""What the laboratory adds to the library, found through entry points (the library never
imports the laboratory).

The laboratory is a distribution of its own, ``lightkv-lab`` (package `lightkv_lab`): the
bundled tasks and tiny models, the trainer, the benchmarks, the demos. It registers

* commands of the ``lightkv`` command line in the entry-point group ``lightkv.commands``:
  each entry's name is the command's name and its object a function ``add(subparsers)``
  that adds that command (``lightkv demo``, ``lightkv bench ...``);
* bundled models in ``lightkv.models``: each entry's name is the model's name
  (``lightkv generate --model scenes``, lmms-eval's ``pretrained=digitgrid``) and its
  object has ``path`` (the model directory) and ``example()`` (a held-out image and
  ``{"question": ..., "answer": ...}``).

Without the laboratory, the commands and models below answer with one line saying to
install it.
"""

from __future__ import annotations

import warnings
from importlib.metadata import EntryPoint, entry_points
from typing import Any

__all__ = [
    "COMMANDS_GROUP",
    "INSTALL",
    "LAB_COMMANDS",
    "LAB_MODELS",
    "MODELS_GROUP",
    "bundled_model",
    "bundled_models",
    "commands",
    "needs_lab",
]

COMMANDS_GROUP = "lightkv.commands"
MODELS_GROUP = "lightkv.models"
INSTALL = "from a clone of the lightkv repository, pip install ./lab (no release is on PyPI yet)"
"""How to install the laboratory. No release of either distribution is on the package index
yet, so the path is the repository's: the library is installed (it says this), and the
laboratory is its ``lab/`` folder (``make install`` installs both, editable)."""
# The two lists below are written out, not derived: they exist for the case where the
# laboratory is NOT installed, when there are no entry points to read them from (and the
# library never imports the laboratory). They are the `lightkv.commands` and
# `lightkv.models` entry points that lab/pyproject.toml declares; tests/test_lab_split.py
# checks them against that file and against the installed entry points.
LAB_COMMANDS = ("bench", "demo", "stages-demo")
"""The laboratory's commands: without it each answers with one line saying to install it."""
LAB_MODELS = ("scenes", "digitgrid", "symbolgrid")
"""The laboratory's bundled models, by name."""


def needs_lab(what: str) -> str:
    """The one-line message for ``what`` when the laboratory is not installed."""
    return f"{what} needs the laboratory (lightkv-lab), which is not installed: {INSTALL}"


def _entries(group: str) -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        found.setdefault(ep.name, ep)
    return found


def _load(ep: EntryPoint, group: str) -> Any | None:
    try:
        return ep.load()
    except Exception as e:  # noqa: BLE001 - a broken plugin must not break the command line
        warnings.warn(
            f"cannot load {ep.name!r} of entry-point group {group} ({ep.value}): "
            f"{type(e).__name__}: {e}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def commands() -> dict[str, Any]:
    """The commands other distributions add (``name -> add(subparsers)``), loaded."""
    loaded = {name: _load(ep, COMMANDS_GROUP) for name, ep in _entries(COMMANDS_GROUP).items()}
    return {name: add for name, add in loaded.items() if add is not None}


def bundled_models() -> list[str]:
    """The names of the bundled models that are installed (without loading them)."""
    return sorted(_entries(MODELS_GROUP))


def bundled_model(name: str) -> Any | None:
    """Bundled model ``name`` (an object with ``path`` and ``example()``), or None where no
    installed distribution registers it."""
    ep = _entries(MODELS_GROUP).get(name)
    return None if ep is None else _load(ep, MODELS_GROUP)
