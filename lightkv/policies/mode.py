"""The mode family: *where* compression happens inside a model, one small class per place.

A mode is a policy like the others: a dataclass whose fields are its settings, registered
once under one name (``@Mode.register("h2o")``), found by that name in YAML (``mode:
{name: h2o, params: {...}}``) and, for a package of its own, in the ``lightkv.modes``
entry-point group under the same name. The pipeline holds at most one configured mode of
its own (`lightkv.Pipeline.mode`, for work that is not a planned stage, such as H2O's
eviction at every decoding step); the modes that run planned stages (``pre_llm``,
``layer``, ``cache``) are named by each stage's `lightkv.policies.StageSpec.mode`.

This module holds the protocol only; the shipped modes and what they hook into live in
`lightkv.adapters.modes` (they need a model). A session copies every mode it runs and
calls `Mode.start` on the copy with its `lightkv.adapters.modes.SessionContext`, so one
pipeline can serve several sessions.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar

from .base import Policy
from .plugins import EntryPointStatus, load_entry_points

__all__ = ["MODE_ENTRY_POINT_GROUP", "Mode"]

MODE_ENTRY_POINT_GROUP = "lightkv.modes"
"""Entry-point group of modes (lightkv's own are listed there too, so that a YAML file can
name them before anything imported a model)."""


class Mode(Policy):
    """Family: a place in the model where compression happens (see the guide "Add a
    compression mode"). Subclass, make the subclass a dataclass whose fields are its
    settings, register it with ``@Mode.register("name")``, and override the hooks you need;
    the session calls only overridden ones, on the layers in `layers`, in increasing
    `order`.

    Hooks (``call`` is a `lightkv.adapters.modes.LayerCall`):

    * ``prefill_pre(call)`` / ``prefill_post(call)``: before / after a decoder layer runs
      in a prefill;
    * ``decode_pre(call)`` / ``decode_post(call)``: the same around each decoding step;
    * ``install()``: hooks on other modules, returned as handles the session removes;
    * ``end_forward()``: the model's forward returned (also after an error).

    Attributes:
        order: modes run in increasing order within each hook (``pre_llm`` 0,
            ``sequence`` 10, ``layer`` 20, ``cache`` and ``h2o`` 30).
        layers: the decoder layers whose forwards the mode sees (None: every layer);
            set in `start`.
        cache_layers: the layers whose cache entries the mode rewrites after they ran (the
            session checks that the model's cache accepts that there).
        text_too: the mode also works on prompts without vision tokens.
        ctx: the session's context (set by `started`).
        own: whether a pipeline may hold the mode as its own (`lightkv.Pipeline.mode`); the
            shipped modes that run planned stages (``pre_llm``, ``layer``, ``cache``) or
            always run (``sequence``, ``tower``) may not.
        beside_stages: whether the mode runs in a pipeline that also plans stages (False:
            it works on the uncompressed prompt, as ``h2o`` does; such a pipeline is
            refused).
    """

    family: ClassVar[str] = "mode"
    order: ClassVar[int] = 50
    own: ClassVar[bool] = True
    beside_stages: ClassVar[bool] = True
    layers: frozenset[int] | None = frozenset()
    cache_layers: frozenset[int] = frozenset()
    text_too: bool = False
    ctx: Any = None
    _entry_points: ClassVar[dict[str, EntryPointStatus]] = {}

    # ---------------------------------------------------------------- registry
    @classmethod
    def _load_entry_points(
        cls, first: str | None = None, done: Callable[[], bool] = lambda: False
    ) -> None:
        load_entry_points(Mode._entry_points, Policy, first, done, group=MODE_ENTRY_POINT_GROUP)

    @classmethod
    def wanted(cls, ctx: Any) -> bool:
        """Run in this session even where neither a stage nor the pipeline names the mode.
        Default: no."""
        return False

    # ---------------------------------------------------------------- settings
    def target_kept_fraction(self, num_layers: int) -> float | None:
        """The vision-KV fraction this mode promises on a ``num_layers`` decoder (averaged
        over layers), or None when it promises none. Default: None."""
        return None

    def at_kept_fraction(self, kept_fraction: float, num_layers: int) -> Mode:
        """This mode's settings at a target vision-KV fraction on a ``num_layers`` decoder,
        for a pipeline whose mode alone does the work (the kept-fraction knob,
        `lightkv.Pipeline.mode_at`). Default: refused (a mode without a knob).

        Raises:
            ValueError: this mode has no knob, or cannot reach the target (then a
                `lightkv.policies.KeptFractionOutOfReach` naming the nearest fraction).
        """
        raise ValueError(
            f"mode {self.name!r} has no kept-fraction knob (it does not override "
            "Mode.at_kept_fraction): set its own parameters instead"
        )

    def knob(self) -> str:
        """What `at_kept_fraction` moves, in a phrase. Default: nothing."""
        return "nothing: this mode has no kept-fraction knob"

    def check_depth(self, num_layers: int) -> None:
        """Raise `ValueError` when the settings do not fit a ``num_layers`` decoder (a
        listed layer beyond it). Default: every depth fits."""

    # ---------------------------------------------------------------- a session's copy
    def started(self, ctx: Any) -> Mode:
        """A copy of this mode for one session, with ``ctx`` set and `start` called."""
        mode = copy.copy(self)
        mode.ctx = ctx
        mode.start()
        return mode

    def start(self) -> None:
        """Set up for the session in ``self.ctx`` (which layers, taps, ...). Default:
        nothing."""

    def covers(self, layer: int) -> bool:
        """Whether the mode sees decoder layer ``layer``'s forwards."""
        return self.layers is None or layer in self.layers

    # ---------------------------------------------------------------- the protocol
    def install(self) -> list[Any]:
        """Hooks on other modules; returns their handles (the session removes them)."""
        return []

    def prefill_pre(self, call: Any) -> None:
        """Before a layer runs in a prefill (may change ``call.hidden`` and
        ``call.kwargs``)."""

    def prefill_post(self, call: Any) -> None:
        """After a layer ran in a prefill (may replace its output or rewrite its cache)."""

    def decode_pre(self, call: Any) -> None:
        """Before a layer runs in a decoding step."""

    def decode_post(self, call: Any) -> None:
        """After a layer ran in a decoding step."""

    def end_forward(self) -> None:
        """The model's forward returned (or raised)."""

    def hook(self, phase: str, when: str) -> Callable[[Any], None] | None:
        """The bound ``{phase}_{when}`` method, or None where this class does not override
        it."""
        method = f"{phase}_{when}"
        overridden = getattr(type(self), method) is not getattr(Mode, method)
        return getattr(self, method) if overridden else None
