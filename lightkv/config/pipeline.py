"""`PipelineConfig`: a whole pipeline as validated data, to and from YAML (the conversions
from pipeline objects are in `lightkv.config.convert`)."""

from __future__ import annotations

import copy
import os
from typing import Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from ..outputs import write_atomic
from ..pipeline import Pipeline
from ..policies import FAMILIES, Mode, Policy, StageSpec, average_kept_fraction
from ..policies.schedulers import place
from ..quirks import ReleasedQuirks
from ..stage import DIVERGENCE_MEMORY_MIB, Stage
from .checks import (
    KNOB,
    check_no_stages,
    check_stages,
    mode_without_schedule,
    planned_stages,
    validated,
    validated_mode,
)
from .errors import ConfigError, _fail
from .errors_pydantic import translate_errors
from .overrides import validated_overrides
from .quirks import ReleasedQuirksConfig
from .schedule import ScheduleConfig
from .specs import (
    STAGE_FIELDS,
    PolicySpec,
    StageField,
)
from .yaml_io import _load_yaml, dump_yaml, read_config_text

__all__ = ["PipelineConfig", "ReleasedQuirksConfig"]


class PipelineConfig(BaseModel):
    """A whole pipeline: description, schedule and the policies of every stage.

    Every stage uses the top-level policies unless ``stage_overrides`` replaces some of
    them for one stage (by 0-based stage index). ``scorer: null`` means no edge scorer
    (pure pruning).
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field("custom", description="A label (preset name) for reports.")
    summary: str = Field("", description="One line for `lightkv presets`.")
    description: str = Field("", description="One paragraph: what the pipeline does and why.")
    source: str = Field("", description="The paper or code the pipeline reproduces.")
    schedule: ScheduleConfig | None = Field(
        default_factory=lambda: ScheduleConfig(name="explicit"),  # 12/18/24, 0.5, 4/2/1 windows
        description="Where to compress, with which windows and ratios; null (the default when "
        "a mode is given) for no stage, the mode doing the work.",
    )
    placement: Literal["planned", "pre_llm", "layer", "cache"] = Field(
        "planned",
        description="Where the planned stages run, at the same vision-KV budget: 'planned' (the "
        "schedule's own places), 'pre_llm' (one stage before decoder layer 0), 'layer' (after "
        "decoder layers) or 'cache' (on each layer's cache after its prefill).",
    )
    mode: PolicySpec | None = Field(
        None,
        description="A mode of the pipeline's own with its settings, for work that is not a "
        "planned stage (`h2o`: eviction at every decoding step); stages name their own modes.",
    )
    partitioner: PolicySpec = Field(default_factory=lambda: PolicySpec(name="grid"))
    scorer: PolicySpec | None = Field(default_factory=lambda: PolicySpec(name="cosine"))
    pruner: PolicySpec = Field(default_factory=lambda: PolicySpec(name="divergence"))
    passer: PolicySpec = Field(default_factory=lambda: PolicySpec(name="relevance_mean"))
    relevance: PolicySpec = Field(default_factory=lambda: PolicySpec(name="query_softmax"))
    stage_overrides: dict[int, dict[StageField, PolicySpec | None]] = Field(
        default_factory=dict, description="Per-stage replacements: {stage index: {field: policy}}."
    )
    layout: Literal["native", "reference"] = Field(
        "native",
        description="How an adapter lays out the vision tokens: 'native' (lightkv: every grid on "
        "its own, structural tokens protected) or 'reference' (the authors' code: on LLaVA-NeXT "
        "the whole anyres sequence of an image, base grid, high-resolution grid and row newlines, "
        "is one span).",
    )
    # Strict: a YAML string such as "false" must not silently turn the option on.
    proportional_attention: StrictBool = Field(
        False,
        description="ToMe's proportional attention: every layer after a merge adds log(size) of "
        "each key to its attention logits (prefill and decoding), so a merged token weighs as the "
        "tokens it stands for.",
    )

    divergence_memory_mib: int = Field(
        DIVERGENCE_MEMORY_MIB,
        ge=1,
        strict=True,
        description="MiB a non-bilinear edge scorer's pairwise intermediates may take at once: it "
        "is evaluated in chunks of windows and source rows within it (same result); cosine and L2 "
        "need no chunks.",
    )
    kept_fraction: float | None = Field(None, gt=0.0, le=1.0, strict=True, description=KNOB)
    released_quirks: ReleasedQuirksConfig = Field(
        default_factory=lambda: ReleasedQuirksConfig(),
        description="What the authors' released code does inside a model that the method does "
        "not; all off except in the lightkv-paper-released presets (LLaVA-1.5 and Qwen2.5-VL "
        "only).",
    )

    _snapshot: Any = PrivateAttr(default=None)
    """The config as validated (plain data), to tell whether it was edited since."""

    def __eq__(self, other: object) -> bool:
        # Policies built during validation are a cache, not part of the value.
        return type(other) is type(self) and self.model_dump() == other.model_dump()  # type: ignore[union-attr]

    @model_validator(mode="before")
    @classmethod
    def _mode_without_schedule(cls, data: Any) -> Any:
        return mode_without_schedule(data)

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, spec: PolicySpec | None) -> PolicySpec | None:
        return None if spec is None else validated_mode(spec)

    @field_validator("summary")
    @classmethod
    def _one_line(cls, summary: str) -> str:
        if "\n" in summary.strip():
            raise _fail("summary", "the summary is one line (put the details in description)")
        return summary

    @field_validator("partitioner", "scorer", "pruner", "passer", "relevance")
    @classmethod
    def _known_policy(cls, spec: PolicySpec | None, info) -> PolicySpec | None:
        if spec is None:  # only scorer is Optional; pydantic rejects None for the others
            return None
        return validated(FAMILIES[info.field_name], spec)

    @field_validator("stage_overrides")
    @classmethod
    def _known_overrides(cls, overrides: dict[int, dict[str, PolicySpec | None]]) -> dict:
        return validated_overrides(overrides, cls.__name__)

    @model_validator(mode="after")
    def _check_composition(self) -> PipelineConfig:
        for f in STAGE_FIELDS:  # defaults are not validated by pydantic: build them here
            spec = getattr(self, f)
            if spec is not None and spec.built() is None:
                setattr(self, f, validated(FAMILIES[f], spec))
        if self.schedule is None:
            check_no_stages(self)
            self._snapshot = self.model_dump()
            return self
        # validation built each spec as a policy of its family (here a Mode)
        if self.mode is not None and not type(cast(Mode, self.mode.built())).beside_stages:
            raise _fail(
                "composition",
                f"mode {self.mode.name!r} works on the uncompressed prompt and does not run "
                "beside stages: remove the schedule (a mode alone plans no stage), or the mode",
                ("mode",),
            )
        if self.placement != "planned" and self.stage_overrides:
            raise _fail(
                "composition",
                f"stage_overrides name stages of the schedule's own places, which placement "
                f"{self.placement!r} moves (and may split or join): give the stages one set of "
                "policies, or keep placement 'planned'",
                ("stage_overrides",),
            )
        quirks = [k for k, v in self.released_quirks.model_dump().items() if v]
        if quirks and self.placement in ("pre_llm", "cache"):
            raise _fail(
                "composition",
                f"released_quirks ({', '.join(quirks)}) apply to merges after a decoder layer, "
                "and the released code has no stage "
                f"{'before the LLM' if self.placement == 'pre_llm' else 'on the cache'}: "
                "turn the quirks off or use placement 'layer' or 'planned'",
                ("placement",),
            )
        limit = self.schedule.max_stages()
        index: int | None  # a stage override's index; None below: the base policies
        for index in self.stage_overrides:
            if limit is not None and index >= limit:
                raise _fail(
                    "stage_index",
                    f"stage index {index} is beyond the schedule, which has {limit} stage(s) "
                    f"(indices 0..{limit - 1})",
                    ("stage_overrides", index),
                )
        base = self._policies()
        indices = [None] + sorted(self.stage_overrides)
        for index in indices:
            policies = dict(base)
            if index is not None:
                policies.update(
                    {
                        f: None if s is None else s.built()
                        for f, s in self.stage_overrides[index].items()
                    }
                )
            try:
                # each field holds a policy of its own family (validated above)
                Stage(spec=StageSpec(0, 0.0, windows_per_side=1), **policies)  # type: ignore[arg-type]
            except ValueError as e:
                where = ("scorer",) if index is None else ("stage_overrides", index)
                raise _fail("composition", str(e), where) from None
        self._snapshot = self.model_dump()
        return self

    # ------------------------------------------------------------------ building
    def _policies(self) -> dict[str, Policy | None]:
        """The policies validation built (shared: read only)."""
        return {
            f: None if getattr(self, f) is None else getattr(self, f).built() for f in STAGE_FIELDS
        }

    def build(self) -> Pipeline:
        """A fresh `lightkv.Pipeline`: copies of the policies and the scheduler that
        validation constructed (new objects on every call; no value is checked or policy
        constructed again).

        Raises:
            ConfigError: the config was edited into an invalid state after loading (an
                edited config is validated again, as a whole).
        """
        cfg = (
            self if self._snapshot == self.model_dump() else type(self).from_dict(self.model_dump())
        )
        overrides: dict[int, dict[str, Policy | None]] = {
            i: {f: None if s is None else s.built() for f, s in fields.items()}
            for i, fields in cfg.stage_overrides.items()
        }
        policies, overrides = copy.deepcopy((cfg._policies(), overrides))
        return Pipeline(
            scheduler=None if cfg.schedule is None else cfg.schedule.build(),
            placement=cfg.placement,
            mode=None if cfg.mode is None else copy.deepcopy(cast(Mode, cfg.mode.built())),
            stage_overrides=overrides,
            name=cfg.name,
            summary=cfg.summary,
            description=cfg.description,
            source=cfg.source,
            layout=cfg.layout,
            proportional_attention=cfg.proportional_attention,
            divergence_memory_mib=cfg.divergence_memory_mib,
            released_quirks=ReleasedQuirks(**cfg.released_quirks.model_dump()),
            kept_fraction=cfg.kept_fraction,
            **policies,  # type: ignore[arg-type]
        )

    def validate_for_model(self, num_layers: int) -> list[StageSpec]:
        """Check the schedule against a decoder of ``num_layers`` layers.

        Returns:
            the stages the pipeline runs on such a model.

        Raises:
            ConfigError: a layer at or beyond the model's depth (the message gives the
                depth), a stage placed where its relevance cannot be computed (as
                `lightkv.apply` refuses it), or a stage override for a stage the model does
                not get.
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigError(
                [("num_layers", f"the model depth must be a positive integer, got {num_layers!r}")]
            )
        stages = planned_stages(self, num_layers)  # [] without a schedule
        try:
            stages = place(stages, self.placement, num_layers)
        except ValueError as e:
            raise ConfigError([("placement", str(e))]) from None
        check_stages(self, stages, num_layers)
        return stages

    def average_kept_fraction(self, num_layers: int) -> float:
        """Vision-KV fraction kept, averaged over the layers of a ``num_layers`` model
        (ignoring rounding)."""
        return average_kept_fraction(self.validate_for_model(num_layers), num_layers)

    # ------------------------------------------------------------------ plain data
    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> PipelineConfig:
        """Validate plain data (as loaded from YAML or JSON).

        Raises:
            ConfigError: what is wrong, field by field.
        """
        if not isinstance(data, dict):
            kind = "an empty document" if data is None else f"a {type(data).__name__}"
            raise ConfigError(
                [("", f"a pipeline config must be a mapping of fields, got {kind}")], source
            )
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = _from_validation_error(e)
            raise (err.with_source(source) if source else err) from None

    def to_dict(self) -> dict[str, Any]:
        """Canonical plain data: empty text fields and overrides left out, policies
        without parameters as bare names."""
        out: dict[str, Any] = {"name": self.name}
        for f in ("summary", "description", "source"):
            if getattr(self, f):
                out[f] = getattr(self, f)
        if self.mode is not None:
            out["mode"] = self.mode.to_yaml_value()
        if self.schedule is None:  # nothing but the mode runs: no policy is listed
            out.update(self._tail())
            return out
        out["schedule"] = self.schedule.to_yaml_value()
        for f in STAGE_FIELDS:
            spec = getattr(self, f)
            out[f] = None if spec is None else spec.to_yaml_value()
        if self.stage_overrides:
            out["stage_overrides"] = {
                i: {f: None if s is None else s.to_yaml_value() for f, s in fields.items()}
                for i, fields in self.stage_overrides.items()
            }
        out.update(self._tail())
        return out

    def _tail(self) -> dict[str, Any]:
        """The model-wide options that differ from their defaults."""
        out: dict[str, Any] = {}
        if self.kept_fraction is not None:
            out["kept_fraction"] = self.kept_fraction
        if self.placement != "planned":
            out["placement"] = self.placement
        if self.layout != "native":
            out["layout"] = self.layout
        if self.proportional_attention:
            out["proportional_attention"] = True
        if self.divergence_memory_mib != DIVERGENCE_MEMORY_MIB:
            out["divergence_memory_mib"] = self.divergence_memory_mib
        quirks = {k: True for k, v in self.released_quirks.model_dump().items() if v}
        if quirks:
            out["released_quirks"] = quirks
        return out

    # ------------------------------------------------------------------ YAML
    @classmethod
    def from_yaml_text(cls, text: str, source: str | None = None) -> PipelineConfig:
        """Parse and validate YAML text.

        Raises:
            ConfigError: invalid YAML (with line and column) or an invalid config.
        """
        return cls.from_dict(_load_yaml(text, source), source)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> PipelineConfig:
        """Read and validate a YAML file.

        Raises:
            FileNotFoundError: no such file, or a directory.
            ConfigError: too large, invalid YAML or an invalid config.
        """
        return cls.from_yaml_text(
            read_config_text(path), "<stdin>" if os.fspath(path) == "-" else str(path)
        )

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """The canonical YAML text (``from_yaml_text(to_yaml())`` gives an equal config);
        also written to ``path`` if given."""
        text = dump_yaml(self.to_dict())
        if path is not None:
            write_atomic(path, text)  # whole or not at all
        return text


def _from_validation_error(err: ValidationError) -> ConfigError:
    """One ``(location, message)`` problem per pydantic error, in lightkv's words."""
    return translate_errors(err, _model_at)


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The model whose field set applies at ``loc`` (for 'unknown field' messages)."""
    if not loc:
        return PipelineConfig
    if loc[0] == "schedule":
        return ScheduleConfig if len(loc) == 1 else PolicySpec
    if loc[0] == "released_quirks":
        return ReleasedQuirksConfig
    return PolicySpec
