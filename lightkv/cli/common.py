"""What every command of the ``lightkv`` command line shares: exit codes, the parser class
that reports usage errors in one line, argument types, and loading a pipeline by name or file."""

from __future__ import annotations

import argparse
import os
import sys

from ..lab import INSTALL

__all__ = [
    "EXTRAS",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "Parser",
    "UsageError",
    "at_most",
    "depth",
    "grid",
    "load_config_or_preset",
    "machine_threads",
    "missing_action",
    "physical_memory",
    "require",
    "writable_dir",
]

PROG = "lightkv"
EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A problem with what the user asked for (exit status 2)."""


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


MAX_GRID_TOKENS = 1024 * 1024
"""The largest image grid a dry run accepts."""


def grid(text: str) -> tuple[int, int]:
    """Argument type ``ROWSxCOLS`` (e.g. ``24x24``) -> ``(rows, cols)``."""
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected ROWSxCOLS such as 24x24, got {text!r}"
        ) from None
    if h < 1 or w < 1:
        raise argparse.ArgumentTypeError(f"grid sides must be positive, got {text!r}")
    if h * w > MAX_GRID_TOKENS:
        raise argparse.ArgumentTypeError(
            f"at most {MAX_GRID_TOKENS:,} tokens (1024x1024; a dry run holds about "
            f"0.2 KB a token), got {text} = {h * w:,}"
        )
    return h, w


def depth(text: str) -> int:
    """Argument type: a positive integer (a decoder depth, a count)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def kept_fraction(text: str) -> float:
    """Argument type: a kept vision-KV fraction in ``(0, 1]`` (the kept-fraction knob)."""
    try:
        t = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < t <= 1.0:  # NaN too
        raise argparse.ArgumentTypeError(
            f"expected a kept fraction in (0, 1] (1 keeps everything), got {text!r}"
        )
    return t


def at_kept_fraction(cfg, fraction: float | None):
    """``cfg`` (a `lightkv.config.PipelineConfig`) with its ``kept_fraction`` set to
    ``fraction`` and validated again (``cfg`` itself when ``fraction`` is None)."""
    if fraction is None:
        return cfg
    return type(cfg).from_dict({**cfg.to_dict(), "kept_fraction": fraction})


def at_most(limit: int, cost: str):
    """Argument type: a positive integer no larger than ``limit``; past it the message says
    what one unit costs (``cost``), so a typo such as ``1e9`` is refused before any work."""

    def parse(text: str) -> int:
        n = depth(text)
        if n > limit:
            raise argparse.ArgumentTypeError(f"at most {limit:,} ({cost}), got {n:,}")
        return n

    parse.__name__ = f"integer <= {limit}"  # argparse names the type in some messages
    return parse


def machine_threads(text: str) -> int:
    """Argument type: torch CPU threads, at most 4 x this machine's cores."""
    cores = os.cpu_count() or 1
    return at_most(4 * cores, f"4 x the {cores} core(s) of this machine; more threads only wait")(
        text
    )


def physical_memory() -> int | None:
    """Bytes of physical memory (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def writable_dir(path):
    """``path`` (a `pathlib.Path`) created if missing and checked writable, before any work.

    Raises:
        UsageError: the path is a file, or cannot be created or written.
    """
    from ..outputs import output_dir_problem

    problem = output_dir_problem(path)
    if problem:
        raise UsageError(f"--out {path}: {problem}")
    return path


EXTRAS = {
    "PIL": "pip install pillow",
    "skimage": "pip install scikit-image",
    "sklearn": "pip install scikit-learn",
    "matplotlib": "pip install matplotlib",
    "tqdm": "pip install tqdm",
    "torch_scatter": "pip install --no-build-isolation torch-scatter",
    "lightkv_lab": INSTALL,
}
"""Top-level module -> how to install it (for one-line errors). Each names a package on
PyPI, or the laboratory's folder (`lightkv.lab.INSTALL`): no release of lightkv is on the
package index yet, so ``pip install 'lightkv[extra]'`` would not find it there."""


def require(*modules: str, why: str = "") -> None:
    """Check, before any work, that optional ``modules`` can be imported.

    Raises:
        UsageError: naming the first missing module and the extra that installs it.
    """
    import importlib.util

    for name in modules:
        if importlib.util.find_spec(name) is None:
            fix = EXTRAS.get(name, f"pip install {name}")
            raise UsageError(
                f"this command needs {name}{' ' + why if why else ''}, which is not installed: "
                f"{fix}"
            )


def missing_action(parser: argparse.ArgumentParser) -> int:
    """A command group called without its action: its help on stderr, exit status 2."""
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def load_config_or_preset(target: str):
    """A preset by name or a pipeline file, as a `lightkv.config.PipelineConfig`; unreadable
    files and unknown names raise `UsageError`, invalid contents `lightkv.config.ConfigError`."""
    from ..presets import load_config

    try:
        return load_config(target)
    except FileNotFoundError as e:
        raise UsageError(str(e).strip("'\"")) from None
    except IsADirectoryError as e:  # pragma: no cover - caught as FileNotFoundError above
        raise UsageError(str(e)) from None
    except PermissionError as e:
        raise UsageError(f"{target}: cannot read the file ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{target}: not a text file") from None
    except ValueError as e:
        from ..config import ConfigError

        if isinstance(e, ConfigError):
            raise
        raise UsageError(str(e)) from None
