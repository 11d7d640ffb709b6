"""The two methods an instrument must order correctly before any number it prints is trusted.

- **Must lose**: `random_pipeline` keeps a content-blind random ``share`` of each image's
  tokens before the LLM (a seeded hash of each token's grid position, `lightkv`'s ``random``
  pruner) and drops the rest.
- **Must win**: `oracle_pipeline` keeps, before the LLM, the tokens the answer is read from
  first (each episode's ``meta["region"]``, which the task records; the region is what the
  oracle knows and no method does), then fills the budget by the tower's [CLS] attention, as
  VisionZip's dominant tokens do. It sets each batch's regions before scoring it
  (`OraclePipeline.score_batches`), so it is scored with the same batches as every method.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from lightkv.methods import TowerAttention

from .budgets import knob_pipeline

__all__ = ["OraclePipeline", "RegionOracle", "oracle_pipeline", "random_pipeline"]


@dataclass
class RegionOracle(TowerAttention):
    """Tower [CLS] attention plus a bonus above every such value on the asked region.

    Attributes:
        regions: bool ``[B, n]`` per row of the batch about to be scored: the image's tokens
            (row-major patches) the answer is read from; set by `OraclePipeline`.
    """

    regions: torch.Tensor | None = field(default=None, repr=False)

    def score(self, queries, keys, layout, tower=None):
        """``[B, N]``: ξ of `TowerAttention`, plus ``1 + max ξ`` on the region's tokens."""
        xi = super().score(queries, keys, layout, tower)
        if self.regions is None:
            raise ValueError("RegionOracle scores only inside OraclePipeline.score_batches")
        if self.regions.shape[0] != layout.batch_size:
            raise ValueError(
                f"regions for {self.regions.shape[0]} rows, the batch has {layout.batch_size}"
            )
        bonus = torch.zeros_like(xi)
        for b in range(layout.batch_size):
            pos = layout.vision_mask[b].nonzero()[:, 0]
            if pos.numel() != self.regions.shape[1]:
                raise ValueError(
                    f"row {b} has {pos.numel()} vision tokens, its region {self.regions.shape[1]}"
                )
            bonus[b, pos] = self.regions[b].to(xi.dtype)
        return xi + bonus * (1 + xi.amax())


@dataclass
class OraclePipeline:
    """A pre-LLM pipeline with a `RegionOracle` relevance, scored batch by batch."""

    pipeline: Any

    @property
    def relevance(self) -> RegionOracle:
        return self.pipeline.relevance

    def score_batches(self, model, convs, grid, batch: int):
        """`lightkv_lab.tasks.scoring.score` per batch of ``batch`` conversations, with that
        batch's regions set first; the results concatenated in order."""
        from lightkv_lab.tasks import scoring as sc

        parts = []
        for i in range(0, len(convs), batch):
            chunk = list(convs[i : i + batch])
            self.relevance.regions = torch.stack([c.first.meta["region"].flatten() for c in chunk])
            parts.append(sc.score(model, chunk, grid, self.pipeline, batch=len(chunk)))
        self.relevance.regions = None
        return concat(parts, [min(batch, len(convs) - i) for i in range(0, len(convs), batch)])


def concat(parts, sizes: list[int]):
    """One `lightkv_lab.tasks.scoring.ScoreResult` from consecutive ones (``sizes``
    conversations each): per-episode fields joined, per-conversation averages weighted."""
    n = sum(sizes)

    def cat(name):
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values)

    def mean(name):
        return sum(getattr(p, name) * k for p, k in zip(parts, sizes, strict=True)) / n

    first = parts[0]
    return replace(
        first,
        qtypes=[q for p in parts for q in p.qtypes],
        correct=cat("correct"),
        logp=cat("logp"),
        logprobs=[x for p in parts for x in p.logprobs],
        followup_correct=cat("followup_correct"),
        followup_logp=cat("followup_logp"),
        followup_logprobs=None
        if first.followup_logprobs is None
        else [x for p in parts for x in p.followup_logprobs],
        kept_fraction=mean("kept_fraction"),
        kv_bytes_vision=mean("kv_bytes_vision"),
        kv_bytes_vision_baseline=mean("kv_bytes_vision_baseline"),
    )


def random_pipeline(num_layers: int, share: float):
    """Keep a random ``share`` of each image's tokens before the LLM (DivPrune's placement,
    the ``random`` pruner)."""
    from lightkv.policies import Pruner

    pipe, _ = knob_pipeline("divprune", num_layers, share)
    return replace(pipe, name="random-pre-llm", pruner=Pruner.create("random"))


def oracle_pipeline(share: float, num_layers: int = 1) -> OraclePipeline:
    """Keep the asked region first, then the tower's most attended tokens, before the LLM."""
    from lightkv.policies import Pruner

    pipe, _ = knob_pipeline("divprune", num_layers, share)
    return OraclePipeline(
        replace(
            pipe,
            name="oracle-region",
            pruner=Pruner.create("lowest_relevance"),
            relevance=RegionOracle(),
        )
    )
