"""`Pipeline`: a schedule of stages (`lightkv.stage.Stage`), where they run, and a mode.

This layer is pure: it imports the graph and the policies only. Loading pipelines from
presets or YAML and applying them to a model are `lightkv.load`, `lightkv.to_yaml` and
`lightkv.apply` (`lightkv.api`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch

from .graph.layout import VisionLayout
from .policies.base import Policy
from .policies.mode import Mode
from .policies.partitioners import GridPartitioner, Partitioner
from .policies.passers import MessagePasser, RelevanceWeightedMean
from .policies.prompt import Prompt
from .policies.pruners import Pruner, SmallestDivergence
from .policies.relevance import QueryAxisSoftmax, Relevance
from .policies.schedulers import (
    PLACEMENTS,
    ExplicitSchedule,
    Scheduler,
    StageSpec,
    average_kept_fraction,
    place,
)
from .policies.schedulers.knob import check_target
from .policies.scorers import CosineDivergence, EdgeScorer
from .quirks import ReleasedQuirks
from .stage import DIVERGENCE_MEMORY_MIB, Stage, StageResult, check_memory

__all__ = ["Pipeline"]


@dataclass
class Pipeline:
    """A scheduler plus the policies of its stages, and optionally a mode of its own.

    Every scheduled stage uses the same policies (``stage_overrides`` can replace
    policies of individual stages by index).

    Attributes:
        scheduler: where to compress, with which windows and ratios (None: no stage; the
            pipeline's `mode` does the work).
        placement: where the planned stages run, at the same vision-KV budget
            (`lightkv.policies.schedulers.placement`): ``planned`` (the schedule's own
            places), ``pre_llm``, ``layer`` or ``cache``.
        mode: a configured mode that runs beside the stages, for work that is not a planned
            stage (`lightkv.adapters.modes.h2o.H2OMode`'s eviction at every decoding
            step); None: only the modes the stages name (`StageSpec.mode`).
        partitioner: windows and A/B split of every stage.
        scorer: edge divergence (None for pure pruning).
        pruner: which A tokens leave.
        passer: how leaving tokens update their partners.
        relevance: how ξ is computed inside a model.
        stage_overrides: ``{stage index: {field: policy}}``.
        name: a label (the preset name, for reports).
        summary: one line for listings (from the pipeline's YAML; kept by ``to_yaml``).
        description: one paragraph: what the pipeline does and why.
        source: the paper or code the pipeline reproduces.
        layout: how adapters lay out vision tokens: ``native`` (every grid on its own,
            structural tokens such as LLaVA-NeXT's row newlines protected) or ``reference``
            (the authors' code: on LLaVA-NeXT an image's whole anyres sequence, newlines
            included, is one span; other families are the same either way).
        proportional_attention: inside a model, every layer after a merge adds
            ``log(size)`` of each key to its attention logits (ToMe's proportional
            attention, Bolya et al., ICLR 2023), so a token that stands for ``k`` originals
            gets the attention weight of ``k`` copies of itself; in prefill and decoding.
            Identity while no token stands for more than one. `run` (no model, no
            attention) is the same either way.
        released_quirks: what the authors' released code does inside a model that the
            method does not (`lightkv.quirks.ReleasedQuirks`: positions renumbered after a
            merge, the first merge layer unmasked); all off except in the
            ``lightkv-paper-released`` presets. `run` is the same either way.
        divergence_memory_mib: the memory budget of every stage's non-bilinear edge
            scorer (`Stage.divergence_memory_mib`); results do not depend on it.
        kept_fraction: the kept-fraction knob: this method at a vision-KV fraction in
            ``(0, 1]``, averaged over layers, on whatever depth the model has (None: the
            schedule as written). Resolved against the depth when the stages are planned
            (`scheduler_at`, `mode_at`): each scheduler family puts itself at the target
            (`Scheduler.at_kept_fraction`) keeping where its stages run, within the
            policies' limits (`max_removal_ratio`); the report's target is this value; a
            target the method cannot reach there is a one-line
            `lightkv.policies.KeptFractionOutOfReach` naming the nearest it can. `placement`
            then moves the fitted stages at that budget.
    """

    scheduler: Scheduler | None = field(default_factory=ExplicitSchedule)
    partitioner: Partitioner = field(default_factory=GridPartitioner)
    scorer: EdgeScorer | None = field(default_factory=CosineDivergence)
    pruner: Pruner = field(default_factory=SmallestDivergence)
    passer: MessagePasser = field(default_factory=RelevanceWeightedMean)
    relevance: Relevance = field(default_factory=QueryAxisSoftmax)
    stage_overrides: dict[int, dict[str, Policy | None]] = field(default_factory=dict)
    name: str = "custom"
    # Text about the pipeline, not what it does: two pipelines that compress alike are equal.
    summary: str = field(default="", compare=False)
    description: str = field(default="", compare=False)
    source: str = field(default="", compare=False)
    layout: str = "native"
    proportional_attention: bool = False
    released_quirks: ReleasedQuirks = field(default_factory=ReleasedQuirks)
    divergence_memory_mib: int = DIVERGENCE_MEMORY_MIB
    placement: str = "planned"
    mode: Mode | None = None
    kept_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.kept_fraction is not None:
            self.kept_fraction = check_target(self.kept_fraction)
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"unknown placement {self.placement!r}; choose one of {', '.join(PLACEMENTS)}"
            )
        if self.scheduler is not None and not isinstance(self.scheduler, Scheduler):
            raise TypeError(
                f"scheduler must be a lightkv.policies.Scheduler or None, got {self.scheduler!r}"
            )
        if self.mode is not None and not isinstance(self.mode, Mode):
            raise TypeError(
                f"mode must be a configured lightkv.policies.Mode (e.g. H2OMode(budget=0.5)) "
                f"or None, got {self.mode!r}"
            )
        if self.scheduler is not None and self.mode is not None and not self.mode.beside_stages:
            raise ValueError(
                f"mode {self.mode.name!r} works on the uncompressed prompt and does not run beside "
                "stages: give it no scheduler (scheduler=None), or compress with stages alone"
            )
        if self.scheduler is None and self.mode is None:
            raise ValueError(
                "a pipeline without a scheduler does nothing: give it a scheduler (its stages) "
                "or a mode (e.g. lightkv.adapters.modes.H2OMode())"
            )
        if not isinstance(self.released_quirks, ReleasedQuirks):
            raise TypeError(
                "released_quirks must be a lightkv.quirks.ReleasedQuirks, "
                f"got {self.released_quirks!r}"
            )
        if self.layout not in ("native", "reference"):
            raise ValueError(
                f"unknown layout {self.layout!r}; "
                "choose 'native' (lightkv) or 'reference' (authors' code)"
            )
        if not isinstance(self.proportional_attention, bool):
            raise TypeError(
                f"proportional_attention must be True or False, got {self.proportional_attention!r}"
            )
        check_memory(self.divergence_memory_mib)

    def stages(self, num_layers: int) -> list[Stage]:
        """The stages for a decoder of ``num_layers`` layers, in layer order.

        Raises:
            ValueError: the schedule does not fit the model.
        """
        stages = []
        for i, spec in enumerate(self.plan(num_layers)):
            # policies by Stage field name (each one typed by Stage's own parameters)
            policies: dict[str, Any] = dict(
                partitioner=self.partitioner,
                scorer=self.scorer,
                pruner=self.pruner,
                passer=self.passer,
                relevance=self.relevance,
            )
            unknown = set(self.stage_overrides.get(i, {})) - set(policies)
            if unknown:
                raise ValueError(
                    f"stage_overrides[{i}] names unknown field(s) {sorted(unknown)}; "
                    f"allowed: {sorted(policies)}"
                )
            policies.update(self.stage_overrides.get(i, {}))
            stages.append(
                Stage(spec=spec, divergence_memory_mib=self.divergence_memory_mib, **policies)
            )
        return stages

    def plan(self, num_layers: int) -> list[StageSpec]:
        """The scheduler's stages for a decoder of ``num_layers`` layers (at `kept_fraction`
        when set: `scheduler_at`), moved to the pipeline's `placement` ([] without a
        scheduler); the pipeline's own mode is checked against the depth too.

        Raises:
            ValueError: the schedule or the mode does not fit the model, or a
                `kept_fraction` it cannot reach there (`KeptFractionOutOfReach`).
        """
        mode = self.mode_at(num_layers)
        if mode is not None:
            mode.check_depth(num_layers)
        scheduler = self.scheduler_at(num_layers)
        if scheduler is None:
            return []
        return place(scheduler.plan(num_layers), self.placement, num_layers)

    def max_removal_ratio(self, index: int, spec: StageSpec) -> float:
        """The largest removal ratio stage ``index`` (with spec ``spec``) can really make:
        the smaller of its partitioner's and its pruner's limits
        (`lightkv.policies.Partitioner.max_removal_ratio`, `Pruner.max_removal_ratio`;
        ``stage_overrides`` included). The kept-fraction knob fits ratios within it."""
        over = self.stage_overrides.get(index, {})
        partitioner = cast(Partitioner, over.get("partitioner", self.partitioner))
        pruner = cast(Pruner, over.get("pruner", self.pruner))
        return min(partitioner.max_removal_ratio(spec), pruner.max_removal_ratio())

    def scheduler_at(self, num_layers: int) -> Scheduler | None:
        """The scheduler the pipeline runs on a ``num_layers`` decoder: `scheduler`, or
        with `kept_fraction` set, the scheduler put at it
        (`Scheduler.at_kept_fraction`, within `max_removal_ratio`).

        Raises:
            lightkv.policies.KeptFractionOutOfReach: a target the schedule cannot reach on
                this depth (one line naming the nearest reachable fraction).
        """
        if self.scheduler is None or self.kept_fraction is None:
            return self.scheduler
        return self.scheduler.at_kept_fraction(
            self.kept_fraction, num_layers, self.max_removal_ratio
        )

    def mode_at(self, num_layers: int) -> Mode | None:
        """The pipeline's own mode on a ``num_layers`` decoder: `mode`, or for a pipeline
        whose mode alone does the work and with `kept_fraction` set, the mode put at it
        (`lightkv.policies.Mode.at_kept_fraction`; with stages the knob moves them)."""
        if self.mode is None or self.kept_fraction is None or self.scheduler is not None:
            return self.mode
        return self.mode.at_kept_fraction(self.kept_fraction, num_layers)

    def resolved(self, num_layers: int) -> Pipeline:
        """A copy for a ``num_layers`` decoder with the knob resolved: its scheduler and mode
        as `scheduler_at` and `mode_at` give them, and no `kept_fraction` (itself without
        one). What it plans is what this pipeline plans there; its promise
        (`target_kept_fraction`) is then its stages' own.

        Raises:
            lightkv.policies.KeptFractionOutOfReach: as `scheduler_at`.
        """
        if self.kept_fraction is None:
            return self
        return replace(
            self,
            scheduler=self.scheduler_at(num_layers),
            mode=self.mode_at(num_layers),
            kept_fraction=None,
        )

    def knob(self) -> str:
        """What `kept_fraction` moves in this pipeline, in a phrase (``lightkv presets
        -v``, the docs)."""
        if self.scheduler is not None:
            return self.scheduler.knob()
        return self.mode.knob() if self.mode is not None else "nothing"

    def modes(self, num_layers: int) -> list[str]:
        """The names of the modes the pipeline runs on a ``num_layers`` decoder: its own
        mode, then those its planned stages name, in plan order (a session adds the modes
        that always run, such as ``sequence``)."""
        own = [] if self.mode is None else [self.mode.name]
        return list(dict.fromkeys(own + [s.mode for s in self.plan(num_layers)]))

    def target_kept_fraction(self, num_layers: int) -> float | None:
        """What the pipeline promises to keep of the vision KV on a ``num_layers`` decoder
        (averaged over layers): `kept_fraction` when set (None where it cannot be reached),
        else its mode's promise, or its stages' (the scheduler's
        `Scheduler.target_kept_fraction`; the placed stages' average under a placement).
        None where neither promises, and where both would act (a mode's promise counts its
        own work only, so neither number alone is what the session keeps)."""
        mode = None if self.mode is None else self.mode.target_kept_fraction(num_layers)
        if self.kept_fraction is not None:  # the knob's target, where the pipeline reaches it
            try:
                self.plan(num_layers)
            except ValueError:
                return None
            return None if self.scheduler is not None and mode is not None else self.kept_fraction
        if self.scheduler is None:
            return mode
        if self.placement != "planned":  # the same budget, by construction of `place`
            try:
                stages = self.plan(num_layers)
            except ValueError:
                return None
            staged = average_kept_fraction(stages, num_layers) if stages else None
        else:
            staged = self.scheduler.target_kept_fraction(num_layers)
        if mode is not None and staged is not None:
            return None
        return staged if mode is None else mode

    def run(
        self,
        hidden: torch.Tensor,
        layout: VisionLayout,
        num_layers: int,
        relevance: torch.Tensor | None = None,
        key_states: torch.Tensor | None = None,
        prompt: Prompt | None = None,
        tower: dict[int, torch.Tensor] | None = None,
    ) -> list[StageResult]:
        """Apply every stage in turn to the same hidden states, without a model.

        Useful to inspect what a schedule does to a layout (demo, docs, tests). ``relevance``
        (``[B, N]`` for the input sequence), ``key_states`` (``[B, N, H_kv, d]``, for
        key-space policies) and ``tower`` (``{layer: [B, H, N]}``, for policies that read the
        vision tower's attention at a layer) are carried along: each survivor keeps its own;
        ``prompt`` (the token ids, at original positions) reaches policies that read the
        prompt.

        Returns:
            one `StageResult` per stage (provenance accumulates across stages).
        """
        results, provenance = [], None
        stages = self.stages(num_layers)
        if any(s.spec.mode == "cache" for s in stages):
            raise ValueError(
                "this pipeline's stages run on a layer's cached keys and values after prefill, "
                "not on hidden states: use lightkv.cache_stage.CacheStage "
                "(or lightkv.apply on a model)"
            )
        for stage in stages:
            res = stage(hidden, layout, relevance, provenance, key_states, prompt, tower)
            hole = res.kept_index < 0
            if relevance is not None:
                relevance = relevance.gather(1, res.kept_index.clamp_min(0)).masked_fill(hole, 0)
            if tower:
                at = res.kept_index.clamp_min(0).unsqueeze(1)
                tower = {
                    k: v.gather(2, at.expand(-1, v.shape[1], -1)).masked_fill(hole.unsqueeze(1), 0)
                    for k, v in tower.items()
                }
            if key_states is not None:
                ks, extra = key_states, [1] * (key_states.dim() - 2)
                index = res.kept_index.clamp_min(0).view(*hole.shape, *extra)
                key_states = ks.gather(1, index.expand(-1, -1, *ks.shape[2:])).masked_fill(
                    hole.view(*hole.shape, *extra), 0
                )
            hidden, layout, provenance = res.hidden, res.layout, res.provenance
            results.append(res)
        return results

    def with_scheduler(self, scheduler: Scheduler | None) -> Pipeline:
        """A copy with another scheduler."""
        return replace(self, scheduler=scheduler)

    def with_mode(self, mode: Mode | None) -> Pipeline:
        """A copy with another mode of its own."""
        return replace(self, mode=mode)

    def at_kept_fraction(self, kept_fraction: float | None) -> Pipeline:
        """A copy at a kept vision-KV fraction on whatever depth the model has (the
        `kept_fraction` knob; None: the schedule as written).

        Examples:
            ```python
            import lightkv

            fastv = lightkv.load("fastv").at_kept_fraction(0.25)
            print([(s.layer, s.removal_ratio) for s in fastv.plan(32)])  # [(1, 0.8)]
            ```

        Raises:
            lightkv.policies.ScheduleError: a value outside ``(0, 1]``.
        """
        return replace(self, kept_fraction=kept_fraction)
