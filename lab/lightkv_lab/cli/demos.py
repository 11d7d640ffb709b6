"""``lightkv demo`` (a bundled LVLM, Scenes by default) and ``lightkv stages-demo`` (the pure core
on a real image): their options are forwarded to the demos' own parsers."""

from __future__ import annotations

import argparse

from lightkv.cli.common import EXIT_OK, PROG

__all__ = ["add_demo", "add_stages_demo"]


def add_demo(commands) -> None:
    """Add ``demo`` to the top-level subparsers (entry point ``demo`` of ``lightkv.commands``)."""
    demo = commands.add_parser(
        "demo",
        help="a bundled LVLM (Scenes by default) answers held-out questions with and without "
        "LightKV (options: lightkv demo --help)",
        add_help=False,  # --help goes to the demo's own parser
    )
    demo.set_defaults(
        func=_cmd_demo, forward_to=_demo_parser
    )  # options forwarded untouched (parse_args)


def add_stages_demo(commands) -> None:
    """Add ``stages-demo`` (entry point ``stages-demo`` of ``lightkv.commands``)."""
    stages = commands.add_parser(
        "stages-demo",
        help="the pure core on a real image, no model needed (options: lightkv stages-demo --help)",
        add_help=False,
    )
    stages.set_defaults(func=_cmd_stages_demo, forward_to=_stages_parser)


def _demo_parser() -> argparse.ArgumentParser:
    from lightkv_lab.demos.bundled import build_parser

    return build_parser(f"{PROG} demo")


def _stages_parser() -> argparse.ArgumentParser:
    from lightkv_lab.stages_demo import build_parser

    return build_parser(f"{PROG} stages-demo")


def _cmd_demo(args: argparse.Namespace) -> int:
    from lightkv_lab.demos.bundled import main as demo_main

    return demo_main(args.forwarded) or EXIT_OK


def _cmd_stages_demo(args: argparse.Namespace) -> int:
    from lightkv_lab.stages_demo import main as demo_main

    return demo_main(args.forwarded, prog=f"{PROG} stages-demo") or EXIT_OK
