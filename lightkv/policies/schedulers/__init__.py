"""Schedulers: at which decoder layers to compress, with which windows and ratios.

Each scheduler, by name (its class: the stages it plans):

- ``explicit`` (`ExplicitSchedule`): fixed layers, ratios and windows.
- ``kept_fraction`` (`KeptFractionSchedule`): relative depths, one ratio fitted to a target
  kept fraction.
- ``scaled`` (`ScaledSchedule`): an explicit schedule for ``ref_depth`` layers, moved to the
  model's depth.
- ``budget`` (`BudgetSchedule`): a scaled schedule placed and fitted to a target kept
  fraction.
- ``pre_llm`` (`PreLLMSchedule`): one stage on the embeddings, before decoder layer 0.
- ``pre_llm_then_layer`` (`PreLLMThenLayer`): a stage on the embeddings, then one at a
  relative depth (VScan).
- ``cache`` (`CacheSchedule`): a stage on each listed layer's cached keys and values, after
  prefill.

Each family puts itself at a target kept fraction with `Scheduler.at_kept_fraction` (the
knob of `lightkv.Pipeline`'s ``kept_fraction``), keeping where its stages run; a target it
cannot reach is a `KeptFractionOutOfReach` naming the nearest one it can
(`lightkv.policies.schedulers.knob`).
"""

from .budget import BudgetFit, BudgetSchedule, budget_schedule
from .cache import CacheSchedule
from .core import (
    TARGET_TOLERANCE,
    KeptFractionOutOfReach,
    ScheduleError,
    Scheduler,
    StageSpec,
    average_kept_fraction,
    ratio_for_target,
)
from .explicit import ExplicitSchedule
from .kept_fraction import KeptFractionSchedule
from .knob import REACH_TOLERANCE, StageCap, scale_layers
from .placement import PLACEMENTS, place
from .pre_llm import PreLLMSchedule
from .scaled import ScaledSchedule
from .two_stage import PreLLMThenLayer

__all__ = [
    "BudgetFit",
    "BudgetSchedule",
    "CacheSchedule",
    "ExplicitSchedule",
    "KeptFractionOutOfReach",
    "KeptFractionSchedule",
    "PLACEMENTS",
    "PreLLMSchedule",
    "PreLLMThenLayer",
    "REACH_TOLERANCE",
    "ScaledSchedule",
    "ScheduleError",
    "Scheduler",
    "StageCap",
    "StageSpec",
    "TARGET_TOLERANCE",
    "average_kept_fraction",
    "place",
    "budget_schedule",
    "ratio_for_target",
    "scale_layers",
]
