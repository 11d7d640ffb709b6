"""Shipped pipelines, as Python objects.

Each preset is a composition of the same policy families; baselines differ from LightKV
only in which policies they pick.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .pipeline import Pipeline
from .policies import (
    CosineDivergence,
    DropMessages,
    ExplicitSchedule,
    GlobalPartitioner,
    GridPartitioner,
    LastTokenAttention,
    LowestRelevance,
    PseudoSquarePartitioner,
    QueryAxisSoftmax,
    RandomPruner,
    RelevanceWeightedMean,
    SizeWeightedMean,
    SmallestDivergence,
    UniformRelevance,
)

__all__ = ["Preset", "PRESETS", "get_preset"]


@dataclass(frozen=True)
class Preset:
    """A named pipeline factory with a one-paragraph description and its source."""

    name: str
    summary: str
    description: str
    build: Callable[[], Pipeline]


def _lightkv() -> Pipeline:
    return Pipeline(
        scheduler=ExplicitSchedule(layers=(12, 18, 24), windows_per_side=(4, 2, 1), ratios=(0.5,)),
        partitioner=GridPartitioner(split="parity"),
        scorer=CosineDivergence(),
        pruner=SmallestDivergence(),
        passer=RelevanceWeightedMean(),
        relevance=QueryAxisSoftmax(),
        name="lightkv",
    )


def _lightkv_paper() -> Pipeline:
    p = _lightkv()
    p.partitioner = PseudoSquarePartitioner(split="parity")
    p.name = "lightkv-paper"
    return p


def _lightkv_no_relevance() -> Pipeline:
    p = _lightkv()
    p.relevance = UniformRelevance()
    p.name = "lightkv-no-relevance"
    return p


def _fastv() -> Pipeline:
    return Pipeline(
        scheduler=ExplicitSchedule(layers=(2,), windows_per_side=(1,), ratios=(0.5,)),
        partitioner=GlobalPartitioner(scope="row", split="all_src"),
        scorer=None,
        pruner=LowestRelevance(),
        passer=DropMessages(),
        relevance=LastTokenAttention(),
        name="fastv",
    )


def _tome() -> Pipeline:
    return Pipeline(
        scheduler=ExplicitSchedule(layers=(12, 18, 24), windows_per_side=(1,), ratios=(0.5,)),
        partitioner=GlobalPartitioner(scope="image", split="parity", src_parity=1),
        scorer=CosineDivergence(),
        pruner=SmallestDivergence(),
        passer=SizeWeightedMean(),
        relevance=UniformRelevance(),
        name="tome",
    )


def _random() -> Pipeline:
    return Pipeline(
        scheduler=ExplicitSchedule(layers=(12, 18, 24), windows_per_side=(1,), ratios=(0.5,)),
        partitioner=GlobalPartitioner(scope="image", split="all_src"),
        scorer=None,
        pruner=RandomPruner(),
        passer=DropMessages(),
        relevance=UniformRelevance(),
        name="random",
    )


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "lightkv",
            "LightKV with true 2-D windows (lightkv's default)",
            "Prompt-aware window merging (Chen, Guo, Zimmermann, 'Make Your LVLM KV Cache More "
            "Lightweight', TMLR 2026): after layers 12/18/24, vision tokens are merged inside 4x4, "
            "2x2, then 1x1 windows per image side, half of each window per stage, each removed "
            "token averaged into its most similar partner weighted by prompt relevance. Windows "
            "are real image regions at every stage and on any grid shape.",
            _lightkv,
        ),
        Preset(
            "lightkv-paper",
            "LightKV with the reference code's pseudo-square windows",
            "The same method with the authors' window arithmetic: survivors are re-packed "
            "row-major into a pseudo-square before windowing, which reproduces the paper's token "
            "counts (576 -> 288 -> 145 -> 73) but makes windows only approximately spatial after "
            "the first stage.",
            _lightkv_paper,
        ),
        Preset(
            "lightkv-no-relevance",
            "LightKV with relevance switched off (uniform weights)",
            "An ablation: LightKV's windows and schedule with plain means instead of "
            "prompt-relevance-weighted merging.",
            _lightkv_no_relevance,
        ),
        Preset(
            "fastv",
            "FastV: drop the least-attended half of vision tokens after layer 2",
            "FastV (Chen et al., 'An Image is Worth 1/2 Tokens After Layer 2', ECCV 2024): "
            "after layer K=2, rank vision tokens by the last token's attention and drop the "
            "lowest R=50%.",
            _fastv,
        ),
        Preset(
            "tome",
            "ToMe: prompt-agnostic global bipartite merging",
            "Token Merging (Bolya et al., ICLR 2023) applied in the decoder: one global "
            "bipartite match per image (alternating tokens as sources and destinations), the "
            "most similar sources merged into their partners with size-weighted means.",
            _tome,
        ),
        Preset(
            "random",
            "Random dropping at LightKV's schedule",
            "A floor for every method: drop a deterministic pseudo-random half of each image's "
            "vision tokens at each of LightKV's stages.",
            _random,
        ),
    ]
}


def get_preset(name: str) -> Pipeline:
    """A fresh pipeline for preset ``name``.

    Raises:
        ValueError: unknown name (the message lists the presets).
    """
    try:
        return PRESETS[name].build()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; available presets: {', '.join(PRESETS)}") from None
