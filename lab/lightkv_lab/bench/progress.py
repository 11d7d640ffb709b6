"""One progress bar for every long laboratory run (`lightkv bench ...`, `lightkv demo`): a tqdm
bar with an ETA on standard error, and nothing at all when standard error is not a terminal
(a log file, CI) or the command was given ``--quiet``."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress"]


class Progress:
    """A bar of ``total`` steps (``desc`` on its left), or a silent stand-in.

    Attributes:
        bar: the tqdm bar, None when quiet.
    """

    def __init__(self, total: int, desc: str, quiet: bool = False, unit: str = "run"):
        self.bar: Any = None
        if not quiet and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)

    def step(self, what: str = "") -> None:
        """One step done; ``what`` is shown beside the bar (what ran last)."""
        if self.bar is not None:
            if what:
                self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)

    __call__ = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
