"""Where results go: output folders checked before any work (a run must not end in an error
about where to write), and every result file written whole or not at all.

`write_atomic` is the one way lightkv writes a file (JSON, markdown, PNG, YAML): into a
temporary file in the same folder, flushed to disk, then renamed over the target with
`os.replace`. A full disk, an interrupted run or an error while rendering leaves the previous
file as it was and no empty or truncated one (the up-front folder check cannot promise room
for the results: creating an empty file succeeds on a full disk). Standard library only, so
every layer of the package may use it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["output_dir_problem", "write_atomic"]

Content = str | bytes | Callable[[BinaryIO], object]
"""What `write_atomic` writes: text (UTF-8), bytes, or a function that writes into an open
binary file (e.g. ``lambda f: fig.savefig(f, format="png")``)."""


def write_atomic(path: str | os.PathLike, content: Content) -> Path:
    """Write ``content`` to ``path`` whole or not at all; returns ``path``.

    The new file keeps the mode of the file it replaces (a new one gets the usual
    ``0o666`` less the umask, not `tempfile`'s private ``0o600``).

    Raises:
        OSError: the folder is missing or the write failed (disk full, ...); ``path`` is
            then as it was before the call, and no temporary file is left.
        Exception: whatever a writer function raises, with the same guarantee.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:
            # a failed write() names no file: name the result that could not be written
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise
    return path


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)  # the only way to read it; set back at once
        os.umask(umask)
        return 0o666 & ~umask


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
