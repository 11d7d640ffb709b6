"""Which calls a session's hooks act on: one session per model, the calls of the thread that
entered it, never a deep copy of the model made inside the ``with`` block.

Internals of `lightkv.adapters.session`. Hooks live in the model's own hook dictionaries, so
``copy.deepcopy(model)`` copies them and a second thread's call runs them too; the
`CallOwner` of a session decides, at the start of each forward, whether the call is the
session's: a call from another thread is refused with a clear error (it would otherwise be
compressed and counted in the session's report), and a deep copy's hooks belong to a copy of
the session that owns no calls, so the copied model runs uncompressed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["ACTIVE", "CallOwner", "cache_of"]

ACTIVE: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Language models that currently have an active session (one session per model)."""


def cache_of(kwargs: Mapping[str, Any]):
    """The KV cache a forward received (``cache`` or ``past_key_values``), or None."""
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


class CallOwner:
    """The thread whose calls a session compresses, and that call's per-forward state.

    ``state`` is thread-local: a refused call from another thread can never overwrite the
    owner's forward in flight.
    """

    def __init__(self) -> None:
        self.thread: int | None = None
        self._local = threading.local()

    @property
    def state(self):
        """The current forward's state (``lightkv.adapters.trace.ForwardState``) in this thread."""
        return getattr(self._local, "state", None)

    @state.setter
    def state(self, value) -> None:
        self._local.state = value

    def claim(self) -> None:
        """The calling thread now owns the session's calls (entering the ``with`` block)."""
        self.thread = threading.get_ident()

    def release(self) -> None:
        """No call is the session's any more (leaving the block)."""
        self.thread = None
        self.state = None

    def admits(self, model: nn.Module) -> bool:
        """Whether this forward is the session's: True in the owning thread, False when the
        session owns no calls (it was left, or it is a deep copy's).

        Raises:
            RuntimeError: a call from another thread while the session is open.
        """
        if self.thread is None:
            return False
        if threading.get_ident() != self.thread:
            raise RuntimeError(
                f"this {type(model).__name__} has a lightkv session open in another thread: its "
                "hooks would compress this call and count it in that session's report; call the "
                "model from the thread that entered the session, or after its `with` block (one "
                "session per model and thread)"
            )
        return True
