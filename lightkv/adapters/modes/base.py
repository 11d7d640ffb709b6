"""The mode protocol: where compression happens inside a session, as one small object.

A `lightkv.adapters.session.CompressionSession` owns the hooks on the model; it does no
compression itself. At every decoder layer's forward it wraps the call in a `LayerCall`
and hands it to each active `Mode` that covers the layer, in `Mode.order`:

* ``prefill_pre(call)`` / ``prefill_post(call)``: before / after the layer runs in a
  prefill forward (empty cache). A pre hook may change ``call.hidden`` and ``call.kwargs``
  (what the layer receives); a post hook may replace the output (`LayerCall.replace_output`).
* ``decode_pre(call)`` / ``decode_post(call)``: the same around each decoding step.
* ``install()``: hooks on other modules (projections, the vision tower), removed with the
  session's; ``end_forward()``: the model's forward has returned (also after an error).

Which modes run is decided once, when the session starts, from the schedule: each planned
`lightkv.policies.StageSpec` names its mode (``StageSpec.mode``), `Scheduler.modes` lists
the names a schedule needs (H2O names ``h2o`` without planning a stage), and a mode may ask
to run whatever the schedule says (`Mode.wanted`: ``sequence``, always; ``tower``, when a
relevance policy reads the vision tower). A new mode is one module: a subclass registered
with ``@Mode.register("name")``, and a scheduler (or stage spec) that names it; a package
can also expose it in the ``lightkv.modes`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, ClassVar

import torch

from ...pipeline import Pipeline, Stage
from ..base import Adapter
from ..cache import _Token
from ..ownership import cache_of
from ..probes import AttentionProbe
from ..proportional import ProportionalAttention
from ..released import ReleasedQuirksHook
from ..trace import ForwardState

__all__ = ["ENTRY_POINT_GROUP", "LayerCall", "Mode", "SessionContext", "choose_modes"]

ENTRY_POINT_GROUP = "lightkv.modes"
"""Entry-point group through which a package exposes modes (the name is the mode's)."""


@dataclass
class SessionContext:
    """What a mode may use of its session: the model's parts and the pipeline, never the
    hooks. Modes keep their own per-forward data in the `ForwardState` a call carries.

    Attributes:
        adapter: the model family's `Adapter`.
        pipeline: the session's pipeline.
        stages: the pipeline's stages for this model's depth, in plan order.
        num_layers: decoder layers.
        probes: one `AttentionProbe` per decoder layer (its projections, norms, RoPE).
        proportional: ``log(size)`` attention (a no-op unless the pipeline asks for it).
        released: the released code's quirks (a no-op unless the pipeline asks for them).
        record: keep each stage's exact inputs in its `StageRecord`.
        reuse_projections: read relevance from a layer's own projections as it runs.
        token: the session's open/closed token for the cache layers it installs.
        modes: the session's modes by name (filled once all are built).
    """

    adapter: Adapter
    pipeline: Pipeline
    stages: list[Stage]
    num_layers: int
    probes: list[AttentionProbe]
    proportional: ProportionalAttention
    released: ReleasedQuirksHook
    record: bool = False
    reuse_projections: bool = True
    token: _Token = field(default_factory=_Token)
    modes: dict[str, Mode] = field(default_factory=dict)

    def stages_in(self, mode: str) -> dict[int, Stage]:
        """The stages whose spec names ``mode``, by layer."""
        return {s.spec.layer: s for s in self.stages if s.spec.mode == mode}


class LayerCall:
    """One decoder layer's forward as the modes see it.

    Attributes:
        layer: the layer's index.
        args, kwargs: what the layer receives (pre hooks may change them).
        state: the forward's `ForwardState` (layout, provenance, trace, ...).
        output: what the layer returned (post hooks only).
        replaced: a post hook replaced ``output``.
    """

    __slots__ = ("layer", "args", "kwargs", "state", "output", "replaced")

    def __init__(
        self,
        layer: int,
        args: tuple,
        kwargs: dict[str, Any],
        state: ForwardState,
        output: Any = None,
    ):
        self.layer, self.args, self.kwargs, self.state = layer, args, kwargs, state
        self.output, self.replaced = output, False

    @property
    def hidden(self) -> torch.Tensor:
        """The layer's input hidden states ``[B, N, D]``."""
        return self.args[0] if self.args else self.kwargs.get("hidden_states")

    @hidden.setter
    def hidden(self, value: torch.Tensor) -> None:
        if self.args:
            self.args = (value, *self.args[1:])
        else:
            self.kwargs["hidden_states"] = value

    @property
    def cache(self):
        """The model's cache object passed to the layer (None without one)."""
        return cache_of(self.kwargs)

    @property
    def output_hidden(self) -> torch.Tensor:
        """The layer's output hidden states (post hooks)."""
        return self.output[0] if isinstance(self.output, tuple) else self.output

    def replace_output(self, hidden: torch.Tensor) -> None:
        """Hand the next layer ``hidden`` instead of the layer's output hidden states."""
        self.output = (hidden, *self.output[1:]) if isinstance(self.output, tuple) else hidden
        self.replaced = True

    def post_result(self) -> Any:
        """What the session's forward hook returns: the replaced output, or None (keep it)."""
        return self.output if self.replaced else None

    def check_layout(self) -> None:
        """Raise when the layer's input does not have the current layout's length."""
        layout = self.state.layout
        if layout is not None and self.hidden.shape[1] != layout.seq_len:
            raise RuntimeError(
                f"layer {self.layer} received {self.hidden.shape[1]} tokens but the layout has {layout.seq_len}; "
                "the model's forward does not match what the adapter expects"
            )


class Mode:
    """Base of the session modes: subclass, set `order` and `layers`, override the hook
    methods you need (the others cost nothing: the session calls only overridden ones),
    and register with ``@Mode.register("name")``.

    Attributes:
        name: the registered name (set by `register`).
        order: modes run in increasing order within each hook (``pre_llm`` 0, ``sequence``
            10, ``layer`` 20, ``cache`` and ``h2o`` 30).
        layers: the decoder layers whose forwards the mode sees (None: every layer).
        cache_layers: the layers whose cache entries the mode rewrites after they ran (the
            session checks that the model's cache accepts that there).
        text_too: the mode also works on prompts without vision tokens (the session then
            gives such a prefill a layout with no images).
    """

    name: ClassVar[str] = ""
    order: ClassVar[int] = 50
    _registry: ClassVar[dict[str, type[Mode]]] = {}
    layers: frozenset[int] | None = frozenset()
    cache_layers: frozenset[int] = frozenset()
    text_too: bool = False

    def __init__(self, ctx: SessionContext) -> None:
        self.ctx = ctx

    # ---------------------------------------------------------------- registry
    @classmethod
    def register(cls, name: str) -> Callable[[type[Mode]], type[Mode]]:
        """Class decorator: run this mode where a schedule names ``name``.

        Raises:
            ValueError: ``name`` is not a non-empty string, or another class is already
                registered under it.
            TypeError: the class is not a subclass of `Mode` (`Mode` itself included: its
                name would become the registered one).
        """
        if not isinstance(name, str) or not name.strip():
            # a None key used to break every later "not registered" message (sorted names)
            raise ValueError(f"a mode is registered under a non-empty name, got {name!r}")

        def deco(impl: type[Mode]) -> type[Mode]:
            if impl is Mode:
                raise TypeError(
                    "register a subclass of lightkv.adapters.modes.Mode, not Mode itself"
                )
            if not (isinstance(impl, type) and issubclass(impl, Mode)):
                raise TypeError(
                    f"{impl!r} must subclass lightkv.adapters.modes.Mode to be registered"
                )
            old = Mode._registry.get(name)
            if old is not None and old is not impl:
                raise ValueError(
                    f"mode {name!r} is already registered by {old.__module__}.{old.__qualname__}"
                )
            impl.name = name
            Mode._registry[name] = impl
            return impl

        return deco

    @classmethod
    def registered(cls) -> dict[str, type[Mode]]:
        """Name -> class of every registered mode."""
        return dict(Mode._registry)

    @classmethod
    def lookup(cls, name: str) -> type[Mode]:
        """The mode registered as ``name`` (a ``lightkv.modes`` entry point loads on demand).

        Raises:
            KeyError: no such mode.
        """
        if name not in Mode._registry:
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                if ep.name == name:
                    ep.load()  # the module registers the class
        if name not in Mode._registry:
            raise KeyError(
                f"the schedule names mode {name!r}, which is not registered; registered: "
                f"{sorted(Mode._registry)} (a package registers one with @Mode.register)"
            )
        return Mode._registry[name]

    @classmethod
    def wanted(cls, ctx: SessionContext) -> bool:
        """Run in this session even where the schedule does not name the mode. Default: no."""
        return False

    # ---------------------------------------------------------------- the protocol
    def covers(self, layer: int) -> bool:
        """Whether the mode sees decoder layer ``layer``'s forwards."""
        return self.layers is None or layer in self.layers

    def install(self) -> list[Any]:
        """Hooks on other modules; returns their handles (the session removes them)."""
        return []

    def prefill_pre(self, call: LayerCall) -> None:
        """Before a layer runs in a prefill."""

    def prefill_post(self, call: LayerCall) -> None:
        """After a layer ran in a prefill."""

    def decode_pre(self, call: LayerCall) -> None:
        """Before a layer runs in a decoding step."""

    def decode_post(self, call: LayerCall) -> None:
        """After a layer ran in a decoding step."""

    def end_forward(self) -> None:
        """The model's forward returned (or raised)."""

    def hook(self, phase: str, when: str) -> Callable[[LayerCall], None] | None:
        """The bound ``{phase}_{when}`` method, or None where this class does not override it."""
        method = f"{phase}_{when}"
        return (
            getattr(self, method)
            if getattr(type(self), method) is not getattr(Mode, method)
            else None
        )


def choose_modes(ctx: SessionContext) -> list[Mode]:
    """The session's modes, in `Mode.order`: those the schedule names and those that want
    to run; ``ctx.modes`` is filled.

    Raises:
        KeyError: the schedule names a mode that is not registered.
    """
    names = list(ctx.pipeline.scheduler.modes(ctx.num_layers))
    names += [n for n, cls in Mode.registered().items() if n not in names and cls.wanted(ctx)]
    modes = sorted((Mode.lookup(n)(ctx) for n in names), key=lambda m: m.order)
    ctx.modes.update((m.name, m) for m in modes)
    return modes
