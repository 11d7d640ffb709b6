"""The ``lightkv`` command line.

```
lightkv presets [-v]                               list the shipped presets
lightkv config show NAME|FILE [--num-layers N] [--kept-fraction T]
                                                   print a pipeline as canonical YAML
lightkv config validate NAME|FILE [--num-layers N] [--grid HxW] [--kept-fraction T]
lightkv config schema                              JSON Schema of pipeline files
lightkv generate --model DIR|ID --image FILE --prompt TEXT
                 [--preset NAME | --config FILE] [--kept-fraction T] [--compare] [--repeats N]
```

With the laboratory installed (``lightkv-lab``; entry-point groups ``lightkv.commands`` and
``lightkv.models``, see `lightkv.lab`), also:

```
lightkv generate [--model scenes|digitgrid|symbolgrid]   bundled model, held-out image and question
lightkv bench efficiency|quality|ablation|scaling|kvquant ...
lightkv demo [--preset NAME] [--questions N]       the bundled Scenes LVLM, with and without LightKV
lightkv stages-demo [--preset NAME]                the pure core on a real image, no model
```

Without it, those commands print one line saying to install it (exit status 2).

Exit status: 0 on success, 1 when a configuration is invalid, 2 on a usage error (bad
arguments, a missing file, an unknown preset). Errors are printed as one line each on
stderr, without a traceback.

The package: `lightkv.cli.common` (exit codes, errors, argument types), one module per
command group (`lightkv.cli.configs`, `lightkv.cli.generate`), and here the parser, the
commands other distributions add, and the entry point.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import warnings
from collections.abc import Sequence

from .. import lab
from . import configs, generate
from .common import EXIT_INVALID, EXIT_OK, EXIT_USAGE, EXTRAS, PROG, Parser, UsageError

__all__ = ["build_parser", "main", "parse_args"]

_DESCRIPTION = """\
Make the KV cache of vision-language models lighter: merge or drop vision tokens during
prefill with pipelines composed of small policies (LightKV, FastV, ToMe, PyramidDrop, ...).
Pipelines are YAML files or shipped presets."""

_EPILOG = """\
examples:
  lightkv presets                               list the presets
  lightkv config show lightkv > mine.yaml       start a pipeline from a preset
  lightkv config validate mine.yaml --num-layers 28
  lightkv config schema > lightkv.schema.json   for editor completion and checks
  lightkv bench efficiency --quick              prefill FLOPs, KV bytes, TTFT, memory, overhead
  lightkv generate --model llava-hf/llava-1.5-7b-hf --image cat.png --prompt "What is this?" \
--compare

exit status: 0 ok, 1 invalid configuration, 2 usage error (bad arguments, missing file,
unknown preset)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation tools)."""
    from .. import __version__

    parser = Parser(
        prog=PROG,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", title="commands", parser_class=Parser
    )
    for group in (configs, generate):
        group.add_commands(commands)
    added = lab.commands()
    for name in sorted(added):
        added[name](commands)
    for name in lab.LAB_COMMANDS:
        if name not in commands.choices:
            _add_missing(commands, name)
    return parser


def _add_missing(commands, name: str) -> None:
    """A laboratory command without the laboratory: any arguments, one line, exit status 2."""

    def run(args: argparse.Namespace) -> int:
        print(f"{PROG}: error: {lab.needs_lab(f'`{PROG} {name}`')}", file=sys.stderr)
        return EXIT_USAGE

    class Anything(argparse.ArgumentParser):  # whatever follows, the answer is the same line
        def parse_args(self, args=None, namespace=None):
            return argparse.Namespace()

    def anything() -> argparse.ArgumentParser:
        return Anything(add_help=False)

    missing = commands.add_parser(
        name, help=f"(needs the laboratory: {lab.INSTALL})", add_help=False
    )
    missing.set_defaults(func=run, forward_to=anything)


# ---------------------------------------------------------------------------- entry point
def parse_args(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parse a command line as `main` does (raises SystemExit on --help or a usage error).

    A command that sets ``forward_to`` (``lightkv demo`` and ``lightkv stages-demo`` of the
    laboratory) gets its options forwarded to the parser that ``forward_to()`` returns.
    """
    parser = parser or build_parser()
    args, forwarded = parser.parse_known_args(argv)
    forward_to = getattr(args, "forward_to", None)
    if forward_to is not None:
        forward_to().parse_args(forwarded)  # validates (and serves --help)
    elif forwarded:
        parser.parse_args(argv)  # argparse's own error for unknown arguments
    args.forwarded = forwarded
    return args


EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as shells report it)."""
_OUTPUT_ERRNOS = (errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT)
"""Write errors that mean the output cannot be stored (a full disk, ``/dev/full``)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 invalid config, 2 usage, 130
    interrupted). Python warnings (e.g. a plugin that fails to load) print as one
    ``lightkv: warning:`` line each, once."""
    shown = warnings.showwarning
    warnings.showwarning = _one_line_warning(set())
    try:
        return _main(argv)
    finally:
        warnings.showwarning = shown


def _one_line_warning(seen: set[str]):
    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message).strip().splitlines()[0] if str(message).strip() else category.__name__
        if text not in seen:
            seen.add(text)
            print(f"{PROG}: warning: {text}", file=sys.stderr)

    return show


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parse_args(argv, parser)
    except SystemExit as e:  # --help, --version, usage errors
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from ..config import ConfigError

    try:
        code = args.func(args)
        sys.stdout.flush()  # a full disk or a closed pipe shows here, not as a traceback at exit
        return code
    except SystemExit as e:  # a forwarded demo's own parser refused its options (it printed why)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    except KeyboardInterrupt:  # Ctrl-C: one line; files are written whole or not at all
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"{PROG}: error: {line}", file=sys.stderr)
        return EXIT_INVALID
    except (
        ModuleNotFoundError
    ) as e:  # an optional dependency: name the extra that brings it, in one line
        top = (e.name or "").split(".")[0]
        fix = EXTRAS.get(top, f"pip install {top or 'it'}")
        print(
            f"{PROG}: error: this command needs {e.name}, which is not installed: {fix}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `lightkv config schema | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:
        if e.errno not in _OUTPUT_ERRNOS:
            raise
        if e.filename:  # a result file (written whole or not at all: the previous one is unchanged)
            print(
                f"{PROG}: error: cannot write {e.filename}: {e.strerror}; any previous file there "
                "is unchanged",
                file=sys.stderr,
            )
            return EXIT_USAGE
        # e.g. `lightkv config schema > /dev/full`: drop what stdout still holds, say why in one
        # line
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (
            OSError,
            ValueError,
            AttributeError,
        ):  # a stdout without a file descriptor (captured)
            pass
        print(f"{PROG}: error: cannot write the output: {e.strerror}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
