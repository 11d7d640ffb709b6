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

Which modes run is decided once, when the session starts (`choose_modes`): the pipeline's
own mode with its settings (`lightkv.Pipeline.mode`: H2O's eviction, which plans no
stage), the mode each planned `lightkv.policies.StageSpec` names (``StageSpec.mode``), and
those that ask to run (`Mode.wanted`: ``sequence``, always; ``tower``, when a relevance
policy reads the vision tower). A new mode is one class (`lightkv.policies.Mode`: a
dataclass whose fields are its settings) registered under one name, which is also its
name in YAML and in the ``lightkv.modes`` entry-point group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ...pipeline import Pipeline
from ...policies.mode import Mode
from ...policies.relevance import Relevance
from ...stage import Stage
from .. import features
from ..base import Adapter
from ..cache import _Token
from ..ownership import cache_of
from ..probes import AttentionProbe
from ..proportional import ProportionalAttention
from ..released import ReleasedQuirksHook
from ..trace import ForwardState

__all__ = ["LayerCall", "Mode", "SessionContext", "choose_modes"]


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

    def relevance(
        self, policy: Relevance, call: LayerCall, raw: dict[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, float]:
        """ξ ``[B, N]`` of any relevance policy at ``call``'s layer, for a mode that scores
        tokens or cache entries (no `Stage` needed), and the FLOPs it cost.

        The policy's declared query rows and key columns are projected from the layer's
        input (``call.hidden``) with its own norm, projections and RoPE, or gathered from
        ``raw``, the layer's own projection outputs for every row as a projection tap reads
        them (`lightkv.adapters.tap.ProjectionTap`; no projection FLOPs then). A policy
        that reads the prompt gets the prefill's token ids; one that reads the vision tower
        gets the ``tower`` mode's attention (the session runs that mode only where a
        stage's relevance reads the tower: it is refused elsewhere); one that reads the
        hidden states gets ``call.hidden``.

        Args:
            policy: a relevance policy (e.g. ``Relevance.create("last_token")``).
            call: the layer's call (its layout, position embeddings and input).
            raw: the layer's projection outputs by `AttentionProbe.projections` name.

        Returns:
            ``(xi, flops)``: ξ in at least float32, and the FLOPs of the projections and
            scores (add them to ``call.state.trace.relevance_flops``).

        Raises:
            ValueError: ``policy`` reads the vision tower and this session has no ``tower``
                mode.
        """
        if policy.reads_tower and "tower" not in self.modes:
            raise ValueError(
                f"relevance {policy.name!r} reads the vision tower's attention, which this "
                "session does not record (no stage's relevance reads it)"
            )
        layout = call.state.layout
        assert layout is not None  # a layer call of a prefill with vision tokens
        tower = self.modes["tower"].per_token(layout) if policy.reads_tower else None  # type: ignore[attr-defined]
        return features.relevance(
            self.probes[call.layer],
            policy,
            call.hidden if raw is None or policy.reads_hidden else None,
            call.kwargs.get("position_embeddings"),
            layout,
            call.layer,
            raw=raw,
            prompt=call.state.prompt,
            tower=tower,
        )


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
        # a decoder layer is always called with its hidden states, by position or by name
        return self.args[0] if self.args else cast(torch.Tensor, self.kwargs.get("hidden_states"))

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
                f"layer {self.layer} received {self.hidden.shape[1]} tokens but the layout has "
                f"{layout.seq_len}; "
                "the model's forward does not match what the adapter expects"
            )


def choose_modes(ctx: SessionContext) -> list[Mode]:
    """The session's modes, in `Mode.order`, each a started copy: the pipeline's own mode
    (`lightkv.Pipeline.mode`, with its settings), those the planned stages name (with their
    default settings unless the pipeline's mode is the same one) and those that want to
    run; ``ctx.modes`` is filled.

    Raises:
        ValueError: a stage names a mode that is not registered.
    """
    configured: dict[str, Mode] = {}
    own = ctx.pipeline.mode_at(ctx.num_layers)  # at the pipeline's kept_fraction, if set
    if own is not None:
        configured[own.name] = own
    for name in dict.fromkeys(s.spec.mode for s in ctx.stages):
        if name not in configured:
            configured[name] = Mode.lookup(name)()
    for name, cls in Mode.registered().items():
        if name not in configured and cls.wanted(ctx):
            configured[name] = cls()
    modes = sorted((m.started(ctx) for m in configured.values()), key=lambda m: m.order)
    ctx.modes.update((m.name, m) for m in modes)
    return modes
