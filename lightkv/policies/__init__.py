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
"""

from .base import ENTRY_POINT_GROUP, Policy
from .cache_policies import (
    AccumulatedAttention,
    ImportancePartitioner,
    accumulated_attention,
    accumulated_attention_flops,
    h2o_keep,
)
from .cdpruner import CDPruner
from .coverage import RelevanceCoverage
from .dart import DART
from .divprune import DivPrune
from .holov import HoloV
from .inputs import Features, StageInputs
from .mmtok import MMTok
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
from .pooling import AnchorPartitioner, ResizePartitioner, StridedPartitioner
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
from .scope import SCOPE
from .scorers import CosineDivergence, EdgeScorer, L2Divergence, RandomDivergence
from .similarity import QuestionSimilarity
from .spatiotemporal import SpatioTemporalPartitioner
from .tower import TowerAttention
from .visionzip import DominantContextual
from .vispruner import VisPruner
from .vscan import VScanScan

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
    "AccumulatedAttention",
    "AnchorPartitioner",
    "ResizePartitioner",
    "DominantContextual",
    "VisPruner",
    "AllSources",
    "CacheSchedule",
    "CDPruner",
    "DART",
    "ImportancePartitioner",
    "accumulated_attention",
    "accumulated_attention_flops",
    "h2o_keep",
    "BudgetSchedule",
    "CosineDivergence",
    "DivPrune",
    "RelevanceCoverage",
    "HoloV",
    "MMTok",
    "SCOPE",
    "VScanScan",
    "DropMessages",
    "EdgeScorer",
    "EntryPointStatus",
    "Features",
    "ExplicitSchedule",
    "GlobalPartitioner",
    "GridPartitioner",
    "KeepSetPruner",
    "KeptFractionSchedule",
    "PreLLMSchedule",
    "PreLLMThenLayer",
    "Prompt",
    "QuestionAttention",
    "QuestionSimilarity",
    "TowerAttention",
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
    "StridedPartitioner",
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
