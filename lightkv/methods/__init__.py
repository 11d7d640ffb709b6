"""The published methods, one module each, with each method's preset YAML beside it.

`lightkv.policies` holds the family protocols, the registry and the generic pieces (grid
windows, cosine divergence, the divergence and keep-set pruners, the weighted-mean passers,
the relevance from a layer's projections, the schedulers). A method that needs a piece no
other method uses keeps it here, in its own module, registered under the name its YAML uses:

| module | presets (YAML beside it) | what the module adds |
|---|---|---|
| `cdpruner` | ``cdpruner``, ``cdpruner-pos`` | the conditional-DPP pruner |
| `dart` | ``dart`` | the duplication-aware pivot pruner |
| `divprune` | ``divprune`` | max-min diversity selection |
| `eadp` | ``eadp`` | entropy-aware dense relevance; weighted facility location |
| `era` | ``era`` | entropy-guided relevance share; saliency-weighted sizes |
| `holov` | ``holov`` | crop-wise budgets by attention and similarity |
| `mmtok` | ``mmtok`` | multimodal coverage selection |
| `scope` | ``scope`` | saliency x coverage selection |
| `tops` | ``tops`` | relevance + coverage + diversity greedy (built from the abstract) |
| `vispruner` | ``vispruner`` | important + diverse selection |
| `visionzip` | ``visionzip`` | dominant / contextual split and merge; the tower attention |
| `vscan` | ``vscan`` | the global and local scans |
| `pooling` | ``pool``, ``downsample`` | anchor, resize and strided (ToMe-SD) partitions |
| `prumerge` | ``prumerge-plus`` | outliers + samples kept, the rest summed; the adaptive schedule |
| `sparsevlm` | ``sparsevlm`` | text raters' attention; top tokens kept, the best pruned recycled |
| `trim` | ``trim`` | question-similarity outliers kept, the rest pooled |
| `cache_policies` | ``elasticcache``, ``h2o`` | importance partition, accumulated attention |
| `lightkv` | ``lightkv``, ``lightkv-*`` | relevance coverage and question similarity |

``fastv``, ``pdrop``, ``tome`` and ``random`` are compositions of generic pieces alone: their
YAML sits here with no module. Importing this package registers every method's policies;
`lightkv.config` does so before it resolves a name.

A preset that carries a paper's name keeps exactly the tokens its authors' released code keeps
on recorded inputs (``tests/methods/fixtures``: the repository and commit of each); lightkv's
own variant of a method ships under a name of its own (``cdpruner-pos``).
"""

from __future__ import annotations

from . import (  # noqa: F401  (each registers its policies)
    cache_policies,
    cdpruner,
    dart,
    divprune,
    eadp,
    era,
    holov,
    lightkv,
    mmtok,
    pooling,
    prumerge,
    scope,
    sparsevlm,
    tops,
    trim,
    visionzip,
    vispruner,
    vscan,
)
from .cache_policies import (
    AccumulatedAttention,
    ImportancePartitioner,
    accumulated_attention,
    accumulated_attention_flops,
    h2o_keep,
)
from .cdpruner import CDPruner
from .dart import DART
from .divprune import DivPrune
from .eadp import EADP
from .era import ERA, SaliencySizes
from .holov import HoloV
from .lightkv import QuestionSimilarity, RelevanceCoverage
from .mmtok import MMTok
from .pooling import AnchorPartitioner, ResizePartitioner, StridedPartitioner
from .prumerge import AdaptivePreLLM, PruMergePlus, WeightedSum
from .scope import SCOPE
from .sparsevlm import PlainMean, RaterAttention, RecycleAll, SparseVLMSplit
from .tops import TOPS
from .trim import TRIMSplit
from .visionzip import DominantContextual, TargetPlusMean, TowerAttention
from .vispruner import VisPruner
from .vscan import VScanScan

__all__ = [
    "AccumulatedAttention",
    "AdaptivePreLLM",
    "AnchorPartitioner",
    "CDPruner",
    "DART",
    "DivPrune",
    "DominantContextual",
    "EADP",
    "ERA",
    "HoloV",
    "ImportancePartitioner",
    "MMTok",
    "PlainMean",
    "PruMergePlus",
    "QuestionSimilarity",
    "RaterAttention",
    "RecycleAll",
    "RelevanceCoverage",
    "ResizePartitioner",
    "SCOPE",
    "SaliencySizes",
    "StridedPartitioner",
    "TOPS",
    "SparseVLMSplit",
    "TRIMSplit",
    "TargetPlusMean",
    "TowerAttention",
    "VScanScan",
    "VisPruner",
    "WeightedSum",
    "accumulated_attention",
    "accumulated_attention_flops",
    "h2o_keep",
]
