"""What every command of the ``lightkv`` command line shares: exit codes, the parser class
that reports usage errors in one line, argument types, and loading a pipeline by name or file."""

from __future__ import annotations

import argparse
import sys

__all__ = ["EXIT_INVALID", "EXIT_OK", "EXIT_USAGE", "PROG", "Parser", "UsageError", "depth", "grid",
           "load_config_or_preset", "missing_action"]

PROG = "lightkv"
EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A problem with what the user asked for (exit status 2)."""


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")



def grid(text: str) -> tuple[int, int]:
    """Argument type ``ROWSxCOLS`` (e.g. ``24x24``) -> ``(rows, cols)``."""
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS such as 24x24, got {text!r}") from None
    if h < 1 or w < 1:
        raise argparse.ArgumentTypeError(f"grid sides must be positive, got {text!r}")
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
