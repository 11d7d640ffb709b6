"""Where benchmarks write by default.

In a source checkout (``pyproject.toml`` beside ``benchmarks/``) results go to the committed
``benchmarks/results/``, which the docs read; in an installed package (a pip install) they go
to ``benchmarks/results/`` under the current directory, never into ``site-packages``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["RESULTS", "results_dir"]


def results_dir(root: Path | None = None, cwd: Path | None = None) -> Path:
    """The default output folder (see the module docstring); ``root`` is the repository, the
    folder above ``lab/lightkv_lab`` (default: where this module is), ``cwd`` the current
    directory."""
    root = root or Path(__file__).resolve().parents[3]
    if (root / "pyproject.toml").is_file() and (root / "benchmarks").is_dir():
        return root / "benchmarks" / "results"
    return (cwd or Path.cwd()) / "benchmarks" / "results"


RESULTS = results_dir()
"""The default output folder, resolved at import."""
