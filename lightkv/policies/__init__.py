"""The policy families a compression stage is composed of.

| family | decides |
|---|---|
| `Partitioner` | windows and the A/B split |
| `EdgeScorer` | divergence between A and B tokens, best partner per A token |
| `Pruner` | which A tokens leave |
| `MessagePasser` | how leaving tokens update their partners |
| `Scheduler` | at which layers, with which windows and ratios |
| `Relevance` | prompt relevance ξ per vision token |
| `Mode` | where in the model compression happens (the shipped ones: `lightkv.adapters.modes`) |

This package holds the families, the registry and the generic pieces; the published methods'
own pieces (CDPruner's DPP, VisionZip's split, ...) live one module each in `lightkv.methods`.
"""

from .base import ENTRY_POINT_GROUP, Policy
from .inputs import Features, StageInputs
from .mode import MODE_ENTRY_POINT_GROUP, Mode
from .partitioners import (
    GlobalPartitioner,
    GridPartitioner,
    Partition,
    Partitioner,
    PseudoSquarePartitioner,
    RelevanceSplit,
)
from .passers import (
    DropMessages,
    MessagePasser,
    RelevanceSizeWeightedMean,
    RelevanceWeightedMean,
    SizeWeightedMean,
)
from .plugins import EntryPointStatus, PluginError
from .prompt import Prompt
from .pruners import (
    AllSources,
    KeepSetPruner,
    LowestRelevance,
    PruneInputs,
    Pruner,
    RandomPruner,
    RelevanceAwareDivergence,
    RelevanceBudget,
    SmallestDivergence,
    allocate_removals,
    exact_removals,
)
from .question import QuestionAttention
from .relevance import (
    LastTokenAttention,
    QueryAxisSoftmax,
    RandomRelevance,
    Relevance,
    TextQueryAttention,
    UniformRelevance,
)
from .schedulers import (
    BudgetSchedule,
    CacheSchedule,
    ExplicitSchedule,
    KeptFractionOutOfReach,
    KeptFractionSchedule,
    PreLLMSchedule,
    PreLLMThenLayer,
    ScaledSchedule,
    ScheduleError,
    Scheduler,
    StageSpec,
    average_kept_fraction,
    budget_schedule,
    ratio_for_target,
    scale_layers,
)
from .scorers import CosineDivergence, EdgeScorer, L2Divergence, RandomDivergence
from .spatiotemporal import SpatioTemporalPartitioner

FAMILIES = {
    family.family: family
    for family in (Partitioner, EdgeScorer, Pruner, MessagePasser, Relevance, Scheduler)
}
"""Family name -> family base class. A family's name is its key in pipeline files and in
error messages (``scorer: cosine``; "unknown scorer 'x'")."""

__all__ = [
    "ENTRY_POINT_GROUP",
    "FAMILIES",
    "MODE_ENTRY_POINT_GROUP",
    "Mode",
    "AllSources",
    "CacheSchedule",
    "BudgetSchedule",
    "CosineDivergence",
    "DropMessages",
    "EdgeScorer",
    "EntryPointStatus",
    "Features",
    "ExplicitSchedule",
    "GlobalPartitioner",
    "GridPartitioner",
    "KeepSetPruner",
    "KeptFractionOutOfReach",
    "KeptFractionSchedule",
    "PreLLMSchedule",
    "PreLLMThenLayer",
    "Prompt",
    "QuestionAttention",
    "L2Divergence",
    "LastTokenAttention",
    "LowestRelevance",
    "MessagePasser",
    "Partition",
    "Partitioner",
    "PluginError",
    "Policy",
    "PruneInputs",
    "Pruner",
    "PseudoSquarePartitioner",
    "QueryAxisSoftmax",
    "RandomDivergence",
    "RandomPruner",
    "Relevance",
    "RelevanceAwareDivergence",
    "RelevanceBudget",
    "RelevanceSizeWeightedMean",
    "RelevanceSplit",
    "RelevanceWeightedMean",
    "ScaledSchedule",
    "ScheduleError",
    "Scheduler",
    "SizeWeightedMean",
    "SmallestDivergence",
    "SpatioTemporalPartitioner",
    "StageInputs",
    "StageSpec",
    "TextQueryAttention",
    "UniformRelevance",
    "RandomRelevance",
    "allocate_removals",
    "average_kept_fraction",
    "exact_removals",
    "budget_schedule",
    "ratio_for_target",
    "scale_layers",
]
