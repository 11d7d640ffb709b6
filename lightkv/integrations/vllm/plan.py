"""What the vLLM plugin runs: a lightkv pipeline checked for vLLM, applied to image embeddings.

This module needs torch and lightkv only (no vLLM), so the main test suite covers it.

vLLM keeps one sequence length per request for all decoder layers, and it sizes a prompt
(the number of image placeholder tokens) when it processes the prompt, before the vision
encoder has run. So a pipeline can run inside vLLM only if

- every stage is pre-LLM (`lightkv.policies.StageSpec.mode` ``"pre_llm"``: the ``pre_llm``
  schedule): one stage on the embeddings, before decoder layer 0, so every layer caches the same
  shorter sequence;
- no policy reads the model's internals: the plugin runs where vLLM embeds an image
  (``embed_multimodal``). Relevance from layer 0's queries and keys (``query_softmax``,
  ``last_token``, ``question_attention``), layer 0's keys, or the vision tower's attention
  (VisionZip, VisPruner) are refused;
- a policy that reads the prompt reads it only as the question's input embeddings
  (`QUESTION_READERS`: ``question_similarity``, CDPruner): the plugin's processor hands each
  image the question's token ids (the text after the prompt's last image, lightkv's
  `lightkv.policies.Prompt.question_mask`), and `select` runs the stage on the image followed
  by the question, as lightkv's adapters run it on the whole prompt;
- the kept count of an image depends on its grid alone (checked when the pipeline is loaded,
  and again for every image).

`PreLLMPlan.load` refuses every other pipeline with an error that says why and what to use.
The selection and merging are lightkv's own `lightkv.Stage`, run on a batch of images (one
image per row), never a second implementation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...pipeline import Pipeline
from ...quirks import ReleasedQuirks
from ...stage import Stage
from .rows import MAX_IMAGE_TOKENS, Selection, check_grid, run_rows

__all__ = [
    "MAX_IMAGE_TOKENS",
    "PIPELINE_KEY",
    "PROMPT_AGNOSTIC_PRESETS",
    "PROMPT_AWARE_PRESETS",
    "QUESTION_READERS",
    "PreLLMPlan",
    "Selection",
    "UnsupportedPipeline",
    "check_grid",
]

PIPELINE_KEY = "lightkv"
"""The model config attribute (set through vLLM's ``hf_overrides``) that names the pipeline."""

PROMPT_AGNOSTIC_PRESETS = ("divprune", "downsample")
"""Shipped presets that run inside vLLM as they are, prompt-blind."""

PROMPT_AWARE_PRESETS = ("cdpruner", "cdpruner-pos", "eadp", "tops", "lightkv-cover", "era")
"""Shipped presets that run inside vLLM as they are and read the question (``lightkv-cover``
and ``era`` with their proportional attention, through the extra head channel of
`lightkv.integrations.vllm.channel`)."""

QUESTION_READERS = frozenset({"question_similarity", "cdpruner", "eadp"})
"""Policies that read the prompt only as the question's input embeddings (`Prompt.question_mask`
over the stage's hidden states), which the plugin gives the stage; other prompt readers are
refused."""


_FIX = (
    "vLLM runs only pre-LLM pipelines: use the presets "
    + ", ".join(repr(p) for p in PROMPT_AGNOSTIC_PRESETS + PROMPT_AWARE_PRESETS)
    + " or a pipeline with `schedule: {name: pre_llm}` and `relevance: uniform` or "
    "`question_similarity` (see docs/guides/vllm.md)"
)


class UnsupportedPipeline(ValueError):
    """A lightkv pipeline that vLLM cannot run; the message says why and what to use."""


def _resolve(spec: Any) -> tuple[Pipeline, str]:
    """A pipeline from a preset name, a YAML path, a mapping (an inline config) or a Pipeline."""
    if isinstance(spec, Pipeline):
        return spec, spec.name or "pipeline"
    if isinstance(spec, dict):
        from ...config import PipelineConfig

        cfg = PipelineConfig.from_dict(spec, source=f"hf_overrides[{PIPELINE_KEY!r}]")
        return cfg.build(), cfg.name or "inline pipeline"
    if isinstance(spec, (str, os.PathLike)):
        from ...api import load

        return load(spec), os.fspath(spec)
    raise UnsupportedPipeline(
        f"hf_overrides[{PIPELINE_KEY!r}] must be a lightkv preset name, a pipeline YAML path or an "
        f"inline pipeline mapping, got {type(spec).__name__}"
    )


def _refusals(pipeline: Pipeline, stages: list[Stage], name: str) -> list[str]:
    why = []
    inside = [s.spec for s in stages if s.spec.mode != "pre_llm"]
    if inside:
        cached = [str(spec.layer) for spec in inside if spec.mode == "cache"]
        after = [str(spec.layer) for spec in inside if spec.mode != "cache"]
        where = "; ".join(
            f"{what} layer(s) {', '.join(layers[:6])}{', ...' if len(layers) > 6 else ''}"
            for what, layers in (("after", after), ("on the cache of", cached))
            if layers
        )
        why.append(
            f"it compresses inside the decoder ({where}): vLLM keeps one KV length for all layers "
            "of a request, so a stage can run only before layer 0 (the pre-LLM mode; see "
            "docs/concepts/serving.md)"
        )
    if len(stages) > 1:
        why.append(f"it has {len(stages)} stages; vLLM can run one, on the embeddings")
    for stage in stages[:1]:
        rel = stage.relevance
        if getattr(rel, "reads_tower", False):
            why.append(
                f"relevance {rel.name!r} reads the vision tower's attention, which vLLM's vision "
                "encoder does not return"
            )
        elif rel.query_rows != "none" or rel.key_cols != "none":
            why.append(
                f"relevance {rel.name!r} is prompt-aware through layer 0's queries and keys over "
                "the prompt, which vLLM computes only inside the decoder (the plugin gives the "
                "stage the question's input embeddings: use `relevance: question_similarity`)"
            )
        elif getattr(rel, "reads_prompt", False) and rel.name not in QUESTION_READERS:
            why.append(
                f"relevance {rel.name!r} reads the prompt otherwise than as the question's input "
                "embeddings, all the plugin gives the stage"
            )
        for policy in (stage.partitioner, stage.scorer, stage.pruner, stage.passer):
            if (
                policy is not None
                and getattr(policy, "reads_prompt", False)
                and policy.name not in QUESTION_READERS
            ):
                why.append(
                    f"{policy.family} {policy.name!r} reads the prompt (its question tokens), which"
                    " the plugin gives only to "
                    + ", ".join(sorted(QUESTION_READERS))
                    + " (not verified for others)"
                )
        if stage.needs:
            why.append(
                f"its policies need {', '.join(sorted(stage.needs))} of layer 0, which vLLM "
                "computes only inside the decoder"
            )
        if stage.tower_layers:
            why.append(
                f"its policies read the vision tower's attention at layer(s) "
                f"{list(stage.tower_layers)}, which vLLM's vision encoder does not return"
            )
    if pipeline.released_quirks != ReleasedQuirks():
        why.append("the released code's quirks act inside the decoder")
    return why


@dataclass(frozen=True)
class PreLLMPlan:
    """A pipeline checked for vLLM: its one pre-LLM `lightkv.Stage`, applied to image embeddings.

    Attributes:
        name: the pipeline's preset name, path or label (for messages).
        pipeline: the lightkv pipeline.
        stage: its one stage (``stage.spec.mode`` is ``"pre_llm"``).
    """

    name: str
    pipeline: Pipeline
    stage: Stage
    _counts: dict[tuple[int, int], int] = field(default_factory=dict, compare=False, repr=False)
    _counts_meta: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def load(cls, spec: Any, num_layers: int) -> PreLLMPlan:
        """Load and check a pipeline for a decoder of ``num_layers`` layers.

        Args:
            spec: a preset name, a YAML path, an inline config mapping, or a `lightkv.Pipeline`.
            num_layers: the language model's depth.

        Raises:
            UnsupportedPipeline: the pipeline cannot run inside vLLM (the message says why).
            ValueError: an unknown preset, an invalid config or a schedule that does not fit.
        """
        pipeline, name = _resolve(spec)
        try:
            stages = pipeline.stages(num_layers)
        except ValueError:
            # A schedule that does not fit this depth: refuse it for what it is, if it is
            # one vLLM could not run on any depth, else say that it does not fit.
            try:
                deep = pipeline.stages(4096)
            except ValueError:
                deep = []
            why = _refusals(pipeline, deep, name) if deep else []
            if why:
                raise UnsupportedPipeline(
                    f"lightkv pipeline {name!r} cannot run inside vLLM: "
                    + "; ".join(why)
                    + f". {_FIX}"
                ) from None
            raise
        if not stages:
            raise UnsupportedPipeline(
                f"lightkv pipeline {name!r} schedules no prefill stage on a {num_layers}-layer "
                f"model (it compresses while decoding, or not at all). {_FIX}"
            )
        why = _refusals(pipeline, stages, name)
        if why:
            raise UnsupportedPipeline(
                f"lightkv pipeline {name!r} cannot run inside vLLM: " + "; ".join(why) + f". {_FIX}"
            )
        plan = cls(name, pipeline, stages[0])
        probe = (6, 10)
        if plan._probe_count(probe, 1) != plan._probe_count(probe, 2):
            raise UnsupportedPipeline(
                f"lightkv pipeline {name!r} keeps a number of tokens that depends on the image's "
                "content: vLLM sizes a prompt before its image is encoded, so the count must "
                f"follow from the grid. {_FIX}"
            )
        return plan

    @property
    def fingerprint(self) -> str:
        """The pipeline's `lightkv.api.fingerprint` (what vLLM's cache keys include); for
        a pipeline with unregistered policies (no canonical YAML), a hash of its ``repr``."""
        if "fingerprint" not in self._counts_meta:
            try:
                from ...api import fingerprint

                value = fingerprint(self.pipeline)
            except Exception:  # a policy outside lightkv's registry: its dataclass repr
                import hashlib

                value = hashlib.sha256(repr(self.pipeline).encode("utf-8")).hexdigest()[:16]
            self._counts_meta["fingerprint"] = value
        return self._counts_meta["fingerprint"]

    @property
    def proportional(self) -> bool:
        """Whether the decoder counts a merged token as the tokens it holds (the pipeline's
        ``proportional_attention``): the model then carries each survivor's ``log(size)``
        and adds it through an extra head channel (`lightkv.integrations.vllm.channel`)."""
        return bool(self.pipeline.proportional_attention)

    @property
    def reads_prompt(self) -> bool:
        """Whether the stage reads the question (`QUESTION_READERS`): `select` then needs each
        image's question, and vLLM's cache keys include it."""
        policies: tuple[object, ...]  # the stage's five policies (the scorer may be None)
        policies = (self.stage.relevance, self.stage.partitioner, self.stage.scorer)
        policies += (self.stage.pruner, self.stage.passer)
        return any(getattr(p, "reads_prompt", False) for p in policies if p is not None)

    @property
    def per_image(self) -> bool:
        """Whether an image's survivors are independent of the prompt's other images (probed
        once on seeded random embeddings: two images and a question in one prompt, then each
        alone with the same question). vLLM encodes each image of a prompt on its own, so a
        pipeline that relates them (``question_similarity`` scales relevance over all images
        of a prompt: lightkv-cover) serves one image per prompt."""
        if "per_image" not in self._counts_meta:
            g = torch.Generator().manual_seed(3)
            a, b, q = (torch.randn(n, 16, generator=g) for n in (60, 24, 3))
            images, grids, ids = [a, b], [(6, 10), (4, 6)], torch.arange(3)
            rows = [(images, grids, q, ids)] + [([e], [gr], q, ids) for e, gr in zip(images, grids)]
            both, *alone = run_rows(self.stage, rows, True)
            same = all(
                torch.equal(x.index, y[0].index)
                and torch.allclose(x.embeds, y[0].embeds, rtol=1e-5, atol=1e-6)
                for x, y in zip(both, alone)
            )
            self._counts_meta["per_image"] = "yes" if same else "no"
        return self._counts_meta["per_image"] == "yes"

    def _probe_count(self, grid: tuple[int, int], seed: int) -> int:
        g = torch.Generator().manual_seed(seed)
        n = grid[0] * grid[1]
        embeds = torch.randn(n, 16, generator=g)
        question = torch.randn(3, 16, generator=g) if seed % 2 == 0 else None
        sel = self.select([embeds], [grid], check=False, questions=[question])[0]
        return int(sel.index.numel())

    def kept_count(self, rows: int, cols: int) -> int:
        """Tokens an image of ``rows x cols`` tokens keeps: what vLLM sizes the prompt with.

        Computed once per grid by running the stage on seeded random embeddings of that
        grid; `select` checks every real image against it."""
        rows, cols = int(rows), int(cols)
        check_grid(rows, cols)
        if (rows, cols) not in self._counts:
            self._counts[rows, cols] = self._probe_count((rows, cols), 0)
        return self._counts[rows, cols]

    def select(
        self,
        embeds: Sequence[torch.Tensor],
        grids: Sequence[tuple[int, int]],
        check: bool = True,
        questions: Sequence[torch.Tensor | None] | None = None,
        question_ids: Sequence[torch.Tensor | None] | None = None,
    ) -> list[Selection]:
        """Run the stage on a batch of images, one image per row (followed by its question).

        Args:
            embeds: per image ``[rows * cols, D]`` embeddings in row-major grid order.
            grids: per image ``(rows, cols)``.
            check: compare each image's kept count with `kept_count` (what vLLM announced).
            questions: per image ``[T, D]`` the input embeddings of its prompt's question (the
                text after the prompt's last image), or None (no question): read by a pipeline
                that `reads_prompt`.
            question_ids: per image ``[T]`` the question's token ids (zeros when not given).

        Returns:
            per image, its `Selection`.

        Raises:
            ValueError: shapes that do not match the grids.
            RuntimeError: an image kept another count than announced.
        """
        if len(embeds) != len(grids):
            raise ValueError(f"{len(embeds)} embeddings for {len(grids)} grids")
        questions = list(questions) if questions is not None else [None] * len(embeds)
        ids = list(question_ids) if question_ids is not None else [None] * len(embeds)
        if not len(questions) == len(ids) == len(embeds):
            raise ValueError(f"{len(questions)} questions for {len(embeds)} images")
        rows = [([e], [g], q, i) for e, g, q, i in zip(embeds, grids, questions, ids)]
        result = [sels[0] for sels in run_rows(self.stage, rows, self.reads_prompt)]
        for sel, grid in zip(result, grids):
            if check and sel.index.numel() != self.kept_count(*grid):
                raise RuntimeError(
                    f"lightkv pipeline {self.name!r} kept {sel.index.numel()} tokens of a {grid} "
                    f"image, but vLLM was told {self.kept_count(*grid)}: its kept count depends on "
                    f"the content. {_FIX}"
                )
        return result
