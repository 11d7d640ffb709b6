"""The ``tower`` mode: the vision tower's own attention, for relevance policies that declare
``reads_tower`` (VisionZip's dominant tokens, `lightkv.methods.TowerAttention`).

It runs wherever such a policy is used (`Mode.wanted`), whatever the schedule: a hook on
the tower layer the projector reads (`lightkv.adapters.tower.TowerTap`) keeps the attention
each patch received, and the hidden-state modes read it per current token
(`per_token`) when they prepare a stage. Stages that run inside the tower would be
another mode beside this one.
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
        ValueError: two stages read the tower with different query rows.
        NotImplementedError: the adapter cannot expose its tower's attention.
    """

    own = False  # runs whenever the session needs it

    order = 40

    @classmethod
    def wanted(cls, ctx: SessionContext) -> bool:
        return any(s.relevance.reads_tower for s in ctx.stages)

    def start(self) -> None:
        ctx = self.ctx
        tap = TowerTap.for_stages(ctx.adapter, ctx.stages)
        assert tap is not None, "the tower mode runs where a stage reads the tower (wanted)"
        self.tap = tap

    def install(self) -> list[Any]:
        return self.tap.install()

    def end_forward(self) -> None:
        self.tap.clear()  # generate runs the tower before the model's forward: forget it only now

    def per_token(self, layout: VisionLayout) -> torch.Tensor:
        """``[B, H, N]``: the attention each current vision token's patch received
        (`TowerTap.per_token`)."""
        return self.tap.per_token(layout)
