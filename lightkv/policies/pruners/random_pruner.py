"""`RandomPruner`: remove tokens at random, by a seeded hash of each token's identity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..hashing import seeded_uniform
from .base import Pruner

__all__ = ["RandomPruner"]


@Pruner.register("random")
@dataclass
class RandomPruner(Pruner):
    """Remove tokens at random: a deterministic hash of each token's grid position and
    ``seed``, so a row gets the same result alone or inside a batch.

    Attributes:
        seed: changes the draw.
    """

    needs_partner: ClassVar[bool] = False
    seed: int = 0

    def key(self, inputs):
        return seeded_uniform(inputs.identity, self.seed)
