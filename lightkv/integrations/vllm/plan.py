"""What the vLLM plugin runs: a lightkv pipeline checked for vLLM, applied to image embeddings.

This module needs torch and lightkv only (no vLLM), so the main test suite covers it.

vLLM keeps one sequence length per request for all decoder layers, and it sizes a prompt
(the number of image placeholder tokens) when it processes the prompt, before the vision
encoder has run. So a pipeline can run inside vLLM only if

- every stage is pre-LLM (`lightkv.policies.StageSpec.mode` ``"pre_llm"``: the ``pre_llm`` schedule):
  one stage on the embeddings, before decoder layer 0, so every layer caches the same
  shorter sequence;
- no policy reads the prompt or the model's internals: the plugin runs where vLLM embeds an
  image (``embed_multimodal``), which sees the image alone. Prompt-aware relevance
  (``query_softmax``, ``last_token``, ``question_attention``), a policy that reads the
  question (CDPruner), layer 0's keys, or the vision tower's attention (VisionZip, VisPruner)
  are refused;
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

from ...graph.layout import ImageSegment, VisionLayout
from ...pipeline import Pipeline, Stage
from ...quirks import ReleasedQuirks

__all__ = [
    "MAX_IMAGE_TOKENS",
    "PIPELINE_KEY",
    "PROMPT_AGNOSTIC_PRESETS",
    "PreLLMPlan",
    "Selection",
    "UnsupportedPipeline",
    "check_grid",
]

PIPELINE_KEY = "lightkv"
"""The model config attribute (set through vLLM's ``hf_overrides``) that names the pipeline."""

PROMPT_AGNOSTIC_PRESETS = ("divprune", "downsample")

MAX_IMAGE_TOKENS = 16384
"""The largest image grid (rows x cols tokens) the plan sizes: Qwen2.5-VL's largest default
image (16,384 merged tokens at ``max_pixels``). DivPrune's probe holds an N x N similarity
(1 GiB in float32 at this size); a 100,000 x 100,000 grid used to allocate 640 GB."""
"""Shipped presets that run inside vLLM as they are."""

_FIX = (
    "vLLM runs only pre-LLM, prompt-agnostic pipelines: use the presets "
    + ", ".join(repr(p) for p in PROMPT_AGNOSTIC_PRESETS)
    + " or a pipeline with `schedule: {name: pre_llm}` and `relevance: uniform` "
    "(see docs/guides/vllm.md)"
)


class UnsupportedPipeline(ValueError):
    """A lightkv pipeline that vLLM cannot run; the message says why and what to use."""


@dataclass(frozen=True)
class Selection:
    """The survivors of one image.

    Attributes:
        embeds: ``[k, D]`` their embeddings (a merged token holds the merge's result).
        index: ``[k]`` int64, ascending: each survivor's index in the image's row-major
            token grid (its original position).
    """

    embeds: torch.Tensor
    index: torch.Tensor


def check_grid(rows: int, cols: int) -> None:
    """Refuse a grid that is not positive or larger than `MAX_IMAGE_TOKENS`, before any tensor.

    Raises:
        ValueError: naming the grid and the limit.
    """
    if rows <= 0 or cols <= 0:
        raise ValueError(f"an image grid must be positive, got {rows} x {cols}")
    if rows * cols > MAX_IMAGE_TOKENS:
        raise ValueError(
            f"an image grid has at most {MAX_IMAGE_TOKENS:,} tokens (Qwen2.5-VL's largest default image)"
            f", got {rows:,} x {cols:,} = {rows * cols:,}"
        )


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
        f"hf_overrides[{PIPELINE_KEY!r}] must be a lightkv preset name, a pipeline YAML path or an inline "
        f"pipeline mapping, got {type(spec).__name__}"
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
            f"it compresses inside the decoder ({where}): vLLM keeps one KV length for all layers of "
            "a request, so a stage can run only before layer 0 (the pre-LLM mode; see "
            "docs/concepts/serving.md)"
        )
    if len(stages) > 1:
        why.append(f"it has {len(stages)} stages; vLLM can run one, on the embeddings")
    for stage in stages[:1]:
        rel = stage.relevance
        if getattr(rel, "reads_tower", False):
            why.append(
                f"relevance {rel.name!r} reads the vision tower's attention, which vLLM's vision encoder "
                "does not return"
            )
        elif (
            getattr(rel, "reads_prompt", False)
            or rel.query_rows != "none"
            or rel.key_cols != "none"
        ):
            why.append(
                f"relevance {rel.name!r} is prompt-aware (it reads the prompt, or the decoder's queries and "
                "keys over it): the plugin runs where vLLM embeds the image, which does not see the prompt"
            )
        for policy in (stage.partitioner, stage.scorer, stage.pruner, stage.passer):
            if policy is not None and getattr(policy, "reads_prompt", False):
                why.append(
                    f"{policy.family} {policy.name!r} reads the prompt (its question tokens), which vLLM "
                    "does not give the image's embedding step"
                )
        if stage.needs:
            why.append(
                f"its policies need {', '.join(sorted(stage.needs))} of layer 0, which vLLM computes only "
                "inside the decoder"
            )
    if pipeline.proportional_attention:
        why.append(
            "proportional attention changes the decoder's attention, which vLLM's kernels do not"
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
                f"lightkv pipeline {name!r} schedules no prefill stage on a {num_layers}-layer model (it "
                f"compresses while decoding, or not at all). {_FIX}"
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
                f"lightkv pipeline {name!r} keeps a number of tokens that depends on the image's content: vLLM "
                f"sizes a prompt before its image is encoded, so the count must follow from the grid. {_FIX}"
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

    def _probe_count(self, grid: tuple[int, int], seed: int) -> int:
        g = torch.Generator().manual_seed(seed)
        n = grid[0] * grid[1]
        return int(
            self.select([torch.randn(n, 16, generator=g)], [grid], check=False)[0].index.numel()
        )

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
        self, embeds: Sequence[torch.Tensor], grids: Sequence[tuple[int, int]], check: bool = True
    ) -> list[Selection]:
        """Run the stage on a batch of images, one image per row.

        Args:
            embeds: per image ``[rows * cols, D]`` embeddings in row-major grid order.
            grids: per image ``(rows, cols)``.
            check: compare each image's kept count with `kept_count` (what vLLM announced).

        Returns:
            per image, its `Selection`.

        Raises:
            ValueError: shapes that do not match the grids.
            RuntimeError: an image kept another count than announced.
        """
        if len(embeds) != len(grids):
            raise ValueError(f"{len(embeds)} embeddings for {len(grids)} grids")
        if not embeds:
            return []
        for r, c in grids:
            check_grid(int(r), int(c))
        sizes = [int(r) * int(c) for r, c in grids]
        for i, (e, n) in enumerate(zip(embeds, sizes)):
            if e.dim() != 2 or e.shape[0] != n:
                raise ValueError(
                    f"image {i}: embeddings {tuple(e.shape)} do not match its {grids[i]} grid ({n} tokens)"
                )
        width, b = max(sizes), len(sizes)
        hidden = embeds[0].new_zeros(b, width, embeds[0].shape[1])
        pad = torch.ones(b, width, dtype=torch.bool)
        for i, (e, n) in enumerate(zip(embeds, sizes)):
            hidden[i, :n] = e
            pad[i, :n] = False
        segments = [
            ImageSegment(row=i, offset=0, grid=(int(r), int(c))) for i, (r, c) in enumerate(grids)
        ]
        layout = VisionLayout.from_segments(
            b, width, segments, padding_mask=pad, device=hidden.device
        )
        relevance = self.stage.relevance.score(None, None, layout).to(hidden.device)
        out = self.stage(hidden, layout, relevance)
        result = []
        for i in range(b):
            row = out.kept_index[i]
            keep = (row >= 0) & (row < sizes[i])
            sel = Selection(out.hidden[i][keep], row[keep])
            if check and sel.index.numel() != self.kept_count(*grids[i]):
                raise RuntimeError(
                    f"lightkv pipeline {self.name!r} kept {sel.index.numel()} tokens of a {grids[i]} image, but "
                    f"vLLM was told {self.kept_count(*grids[i])}: its kept count depends on the content. {_FIX}"
                )
            result.append(sel)
        return result
