"""The ``tower`` mode: the vision tower's own attention, for relevance policies that declare
``reads_tower`` (VisionZip's dominant tokens, `lightkv.methods.TowerAttention`) and for
policies that name ``tower_layers`` (VScan's local scan).

It runs wherever such a policy is used (`Mode.wanted`), whatever the schedule: a hook on
the tower layer the projector reads, and one on each named layer
(`lightkv.adapters.tower.TowerTap`), keeps the attention each patch received, and the
hidden-state modes read it per current token (`per_token`) when they prepare a stage. Stages
that run inside the tower would be another mode beside this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...graph.layout import VisionLayout
from ..tower import TowerTap
from .base import Mode, SessionContext

__all__ = ["TowerMode"]


@Mode.register("tower")
@dataclass
class TowerMode(Mode):
    """Reads the tower's attention in every forward that runs the tower.

    Raises (at session start):
        ValueError: two stages read the tower with different query rows; a policy names a
            tower layer the model's tower does not have.
        NotImplementedError: the adapter cannot expose its tower's attention.
    """

    own = False  # runs whenever the session needs it

    order = 40

    @classmethod
    def wanted(cls, ctx: SessionContext) -> bool:
        return any(s.relevance.reads_tower or s.tower_layers for s in ctx.stages)

    def start(self) -> None:
        ctx = self.ctx
        tap = TowerTap.for_stages(ctx.adapter, ctx.stages)
        self.tower_taps: dict[int | None, TowerTap] = {} if tap is None else {None: tap}
        for stage in ctx.stages:
            for policy in (stage.partitioner, stage.scorer, stage.pruner, stage.passer):
                for layer in getattr(policy, "tower_layers", ()):
                    if layer not in self.tower_taps:
                        self.tower_taps[layer] = TowerTap.at_layer(ctx.adapter, layer, policy)

    def install(self) -> list[Any]:
        return [h for tap in self.tower_taps.values() for h in tap.install()]

    def end_forward(self) -> None:
        # generate runs the tower before the model's forward: forget it only now
        for tap in self.tower_taps.values():
            tap.clear()

    def per_token(self, layout: VisionLayout, layer: int | None = None) -> torch.Tensor:
        """``[B, H, N]``: the attention each current vision token's patch received at the
        layer the projector reads (``layer`` None) or at tower layer ``layer``
        (`TowerTap.per_token`)."""
        return self.tower_taps[layer].per_token(layout)
