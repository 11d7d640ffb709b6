"""Output folders checked before any work: a run must not end in an error about where to
write. Shared by the command line, the demos and the benchmarks."""

from __future__ import annotations

import tempfile
from pathlib import Path

__all__ = ["output_dir_problem"]


def output_dir_problem(path: Path | str) -> str | None:
    """Create ``path`` (with its parents) if missing and write a scratch file in it; returns
    None when that works, else what is wrong, as a short phrase ("not a directory", "cannot
    write there (Permission denied)"). Asking the file system, not the permission bits, so
    root, read-only mounts and ``/proc`` answer truthfully."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        return "not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"cannot write there ({e.strerror or e})"
    return None
