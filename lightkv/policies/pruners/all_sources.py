"""`AllSources`: remove every A token of a window with B tokens (the partitioner decides
what leaves)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Pruner

__all__ = ["AllSources"]


@Pruner.register("all_sources")
@dataclass
class AllSources(Pruner):
    """Remove every A token of every window that has B tokens: the partitioner decides
    alone what leaves (VisionZip's ``dominant_context``, the ``resize`` downsampling), so
    the stage's ratio is spent there, not here (at ratio 0 nothing leaves).
    """

    def budget(self, graph, ratio):
        """``[K]``: ``|A_w|`` where the window has B tokens, else 0; 0 everywhere at ratio 0."""
        every = torch.where(graph.dst_count > 0, graph.src_count, torch.zeros_like(graph.src_count))
        return every if ratio > 0 else torch.zeros_like(every)

    def key(self, inputs):
        return inputs.divergence
