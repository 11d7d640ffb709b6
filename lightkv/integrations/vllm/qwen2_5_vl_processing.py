"""Qwen2.5-VL's processing for lightkv's vLLM model: the pipeline of a model config
(`plan_for`), images only, one placeholder per kept token, and cache keys that name the
pipeline (and the question). `lightkv.integrations.vllm.qwen2_5_vl` registers the processor
with its model; this module imports vLLM internals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from . import check_version

check_version()  # before importing the internals this module subclasses

import torch
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLMultiModalProcessor,
    Qwen2_5_VLProcessingInfo,
)
from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem
from vllm.multimodal.processing import PromptReplacement, PromptUpdate

from .plan import PIPELINE_KEY, PreLLMPlan
from .question import QUESTION_FIELD, question_ids, question_tag

__all__ = ["LightKVQwen2_5_VLProcessingInfo", "LightKVQwen2_5_VLProcessor", "plan_for"]

_PLANS: dict[tuple[str, int], PreLLMPlan] = {}


def plan_for(hf_config: Any) -> PreLLMPlan:
    """The checked pipeline named by ``hf_config.lightkv`` (one per engine configuration).

    Raises:
        ValueError: the config names no pipeline, or a pipeline vLLM cannot run
            (`lightkv.integrations.vllm.plan.UnsupportedPipeline`).
    """
    spec = getattr(hf_config, PIPELINE_KEY, None)
    if spec is None:
        raise ValueError(
            f"{type(hf_config).__name__} names no lightkv pipeline: pass "
            f"hf_overrides={{'architectures': [...], {PIPELINE_KEY!r}: 'divprune'}} (a preset name,"
            " a YAML path or an inline pipeline mapping)"
        )
    text = getattr(hf_config, "text_config", hf_config)
    layers = int(text.num_hidden_layers)
    key = (repr(spec), layers)
    if key not in _PLANS:
        _PLANS[key] = PreLLMPlan.load(spec, layers)
    return _PLANS[key]


class LightKVQwen2_5_VLProcessingInfo(Qwen2_5_VLProcessingInfo):
    """Qwen2.5-VL's processing info, for images only."""

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        """Images without limit; no videos (lightkv's plugin compresses images)."""
        return {"image": None}

    def parse_mm_data(self, mm_data: Any, *, validate: bool = True) -> Any:
        """Refuse videos first (before vLLM parses them), with a message that names the plugin."""
        if isinstance(mm_data, Mapping) and _has_video(mm_data.get("video")):
            _refuse_video()
        return super().parse_mm_data(mm_data, validate=validate)

    def validate_num_items(self, modality: str, num_items: int) -> None:
        """Refuse videos with a message that names the plugin; otherwise vLLM's checks."""
        if modality == "video" and num_items > 0:
            _refuse_video()
        super().validate_num_items(modality, num_items)


def _has_video(video: Any) -> bool:
    """Whether ``multi_modal_data["video"]`` holds a video: vLLM's warm-up passes an empty
    list (no videos) beside its dummy images, which must not be refused."""
    if video is None:
        return False
    if isinstance(video, (list, tuple)):
        return len(video) > 0
    return True


def _refuse_video() -> None:
    raise ValueError(
        "lightkv's vLLM plugin compresses images only: a video cannot go through "
        "LightKVQwen2_5_VLForConditionalGeneration; serve videos with the stock architecture "
        "(vLLM's own EVS pruning: --video-pruning-rate)"
    )


class LightKVQwen2_5_VLProcessor(Qwen2_5_VLMultiModalProcessor):
    """Qwen2.5-VL's processor with one placeholder per token the pipeline keeps, and
    multimodal hashes that name the pipeline."""

    def _get_mm_hashes(self, inputs: Any) -> Any:
        """Each image's hash, over the image, the pipeline's `lightkv.api.fingerprint` and,
        for a pipeline that reads the question, the question's token ids (`question_tag`).

        vLLM keys its processor cache, its encoder cache and its prefix cache (the extra keys of
        a block's hash) with these hashes, and hands them to KV connectors (LMCache, ...): a
        compressed image's KV is found again only under the same pipeline (and question),
        never another's, also when engines with different pipelines share one external KV
        store. A client's ``multi_modal_uuids`` stand for the image only, so the plugin adds
        its tag to them too."""
        plan = plan_for(self.info.get_hf_config())
        tag = f"lightkv:{plan.fingerprint}"
        if plan.reads_prompt:
            token = self.info.get_hf_config().image_token_id
            tag += f"#q:{question_tag(question_ids(self._prompt_ids(inputs.prompt), token))}"
        hashes = inputs.get_mm_hashes(
            f"{self.info.model_id}#{tag}", self.info.ctx.get_mm_config().mm_hasher_algorithm
        )
        uuids = getattr(inputs, "mm_uuid_items", None) or {}
        return {
            modality: [
                f"{h}#{tag}" if h is not None and h in (uuids.get(modality) or ()) else h
                for h in items
            ]
            for modality, items in hashes.items()
        }

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.info.get_tokenizer().encode(prompt, add_special_tokens=False))
        return [int(t) for t in prompt]

    def apply(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's processing; for a pipeline that reads the question, each image item also
        carries its prompt's question (`QUESTION_FIELD`: the token ids after the last image),
        which `embed_multimodal` gives the stage. Items vLLM marks as cached elsewhere (None)
        are keyed by a hash that includes the same question."""
        out = super().apply(inputs, *args, **kwargs)
        if plan_for(self.info.get_hf_config()).reads_prompt:
            token = self.info.get_hf_config().image_token_id
            ids = torch.tensor(question_ids(out["prompt_token_ids"], token), dtype=torch.long)
            for item in out["mm_kwargs"].get("image", []):
                if item is not None:
                    item[QUESTION_FIELD] = MultiModalFieldElem(
                        data=ids, field=MultiModalBatchedField(keep_on_cpu=True)
                    )
        return out

    def _get_prompt_updates(
        self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, Any], out_mm_kwargs: Any
    ) -> Sequence[PromptUpdate]:
        updates = list(super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs))
        plan = plan_for(self.info.get_hf_config())
        merge = self.info.get_image_processor(**hf_processor_mm_kwargs).merge_size
        token = self.info.get_tokenizer().get_vocab()[
            self.info.get_hf_processor(**hf_processor_mm_kwargs).image_token
        ]

        def image_tokens(item_idx: int) -> list[int]:
            _, h, w = (int(x) for x in out_mm_kwargs["image"][item_idx]["image_grid_thw"].data)
            return [token] * plan.kept_count(h // merge, w // merge)

        return [
            PromptReplacement(modality="image", target=[token], replacement=image_tokens)
            if update.modality == "image"
            else update
            for update in updates
        ]
