"""lightkv's Qwen2.5-VL for vLLM: vLLM's own model, its image embeddings compressed by a
lightkv pre-LLM stage before the language model sees them.

Three parts, each a small subclass of vLLM's Qwen2.5-VL classes:

- `LightKVQwen2_5_VLProcessingInfo`: images only (a video is refused with a message);
- `LightKVQwen2_5_VLProcessor`: the number of placeholder tokens of each image is the
  pipeline's kept count for the image's grid (`PreLLMPlan.kept_count`), because vLLM sizes
  the prompt before the vision encoder runs; for a pipeline that reads the question, each
  image item carries its prompt's question and its hash names it
  (`lightkv.integrations.vllm.question`);
- `LightKVQwen2_5_VLForConditionalGeneration`: after the vision encoder, `PreLLMPlan.select`
  (lightkv's `lightkv.Stage`, given the question's input embeddings from the language
  model's table where the pipeline reads them) chooses and merges each image's tokens; each
  survivor carries
  its original M-RoPE position, which vLLM's multimodal pruning support
  (``SupportsMultiModalPruning.recompute_mrope_positions``, the path of its EVS video
  pruning) writes into the request's positions.

Positions are lightkv's: survivors keep their original ``(t, h, w)`` M-RoPE ids and the text
after an image starts where it would without compression (the image's start plus
``max(rows, cols)``), so a ratio-0 pipeline reproduces stock vLLM exactly. The fourth
position channel therefore carries ``max(rows, cols)``, where vLLM's EVS puts the grid's
width (the same for the square and wide grids EVS was built for).

The pipeline is the model config's ``lightkv`` attribute, set with ``hf_overrides``. This
module imports vLLM internals; `lightkv.integrations.vllm.register` registers it lazily.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import check_version

check_version()  # before importing the internals this module subclasses

import numpy as np
import torch
from vllm.model_executor.models.qwen2_5_vl import (
    Qwen2_5_VLDummyInputsBuilder,
    Qwen2_5_VLForConditionalGeneration,
)
from vllm.multimodal import MULTIMODAL_REGISTRY

from ...adapters.bias import log_sizes
from .question import QUESTION_FIELD, question_list
from .qwen2_5_vl_processing import (
    LightKVQwen2_5_VLProcessingInfo,
    LightKVQwen2_5_VLProcessor,
    plan_for,
)

__all__ = [
    "LightKVQwen2_5_VLForConditionalGeneration",
    "LightKVQwen2_5_VLProcessingInfo",
    "LightKVQwen2_5_VLProcessor",
    "plan_for",
]


def _ids_on(input_ids: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The prompt's token ids as a 1-D int64 tensor on ``device``, from a list (vLLM 0.32) or a
    tensor on any device (vLLM 0.33, PR 46535), without a round trip through the host."""
    if isinstance(input_ids, torch.Tensor):
        return input_ids.reshape(-1).to(device=device, dtype=torch.long)
    return torch.as_tensor(list(input_ids), dtype=torch.long, device=device)


@MULTIMODAL_REGISTRY.register_processor(
    LightKVQwen2_5_VLProcessor,
    info=LightKVQwen2_5_VLProcessingInfo,
    dummy_inputs=Qwen2_5_VLDummyInputsBuilder,
)
class LightKVQwen2_5_VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL whose image embeddings pass through a lightkv pre-LLM stage.

    Attributes:
        lightkv_plan: the checked pipeline (`PreLLMPlan`).
    """

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        if getattr(config, "model_type", None) != "qwen2_5_vl":
            raise ValueError(
                "LightKVQwen2_5_VLForConditionalGeneration needs a Qwen2.5-VL checkpoint "
                f"(model_type 'qwen2_5_vl'), got model_type {getattr(config, 'model_type', None)!r}"
            )
        plan = plan_for(config)
        mm = vllm_config.model_config.get_multimodal_config()
        if mm.is_multimodal_pruning_enabled():
            raise ValueError(
                "lightkv's vLLM plugin and vLLM's video pruning (EVS, --video-pruning-rate) cannot"
                " be combined: unset video_pruning_rate"
            )
        if vllm_config.use_v2_model_runner:
            raise ValueError(
                "lightkv's vLLM plugin runs on vLLM's V1 model runner, whose multimodal pruning "
                "path it uses: set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        images = mm.get_limit_per_prompt("image")
        if plan.reads_prompt and not plan.per_image and (images is None or images > 1):
            raise ValueError(
                f"lightkv pipeline {plan.name!r} relates the images of a prompt (its selection of "
                "one image depends on the others), and vLLM encodes each image on its own: set "
                "limit_mm_per_prompt={'image': 1}"
            )
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.lightkv_plan = plan
        self.lightkv_log_sizes = None
        if plan.proportional:  # the bias through one more head channel, exactly
            from .channel import install_channel

            self.lightkv_log_sizes = install_channel(self.language_model, vllm_config)
        # Embeddings leave `embed_multimodal` with 4 position channels appended (as with EVS):
        # no encoder CUDA graphs for them, and the runner recomputes positions (see `runner`).
        self.is_multimodal_pruning_enabled = True

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list[Any]
    ) -> tuple[torch.Tensor, int]:
        """M-RoPE positions ``[3, N]`` of the compressed prompt, and the decoding delta.

        Text positions are final: sequential, and after an image the image's start plus
        ``max(rows, cols)`` as without compression. An image's kept tokens get the image's
        start as a placeholder; `embed_multimodal` carries their real positions, which vLLM
        writes in when it gathers the embeddings (``recompute_mrope_positions``)."""
        merge = self.config.vision_config.spatial_merge_size
        parts, token, position = [], 0, 0
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            if feature.modality != "image":
                raise ValueError(
                    "lightkv's vLLM plugin compresses images only: a video reached the model"
                )
            _, h, w = (int(x) for x in feature.data["image_grid_thw"].data.tolist())
            offset, length = feature.mm_position.offset, feature.mm_position.length
            text = offset - token
            parts += [
                np.broadcast_to(np.arange(text), (3, text)) + position,
                np.full((3, length), position + text),
            ]
            position += text + max(h // merge, w // merge)
            token = offset + length
        tail = len(input_tokens) - token
        parts.append(np.broadcast_to(np.arange(tail), (3, tail)) + position)
        positions = np.concatenate(parts, axis=1).astype(np.int64)
        delta = int(positions.max()) + 1 - len(input_tokens) if positions.size else 0
        return torch.from_numpy(positions), delta

    def recompute_mrope_positions(
        self,
        input_ids: list[int] | torch.Tensor,
        multimodal_embeddings: Sequence[torch.Tensor],
        mrope_positions: torch.Tensor,
        num_computed_tokens: int,
    ) -> tuple[list[torch.Tensor], torch.Tensor, int]:
        """Write the survivors' positions into the request's ``[3, N]`` M-RoPE positions.

        vLLM calls this for every prefill chunk with the slices of image embeddings that the
        chunk holds, in prompt order; together they are the prompt's image tokens from
        ``num_computed_tokens`` on. Each token's position is its image's start (the position
        after the image's ``<|vision_start|>``) plus its own ``(t, h, w)`` channels; text
        positions are already final (`get_mrope_input_positions`).

        ``input_ids`` is a Python list in vLLM 0.32's V1 runner and a 1-D tensor, possibly on the
        device, after vLLM PR 46535 (0.33's V2 runner); both are read on the positions' device.

        vLLM's own helper (for EVS) is not used: in 0.32.0 it counts the image tokens seen
        before the chunk once, so a chunk that finishes one image and starts another writes
        the second image over the first.

        Returns:
            the embeddings without their position channels, the positions, and the decoding
            delta (``max position + 1 - N``).
        """
        out = [mm[:, :-4] for mm in multimodal_embeddings]  # the log-size column stays
        positions = mrope_positions.clone()
        if multimodal_embeddings:
            device = positions.device
            ids = _ids_on(input_ids, device)
            media = torch.nonzero(ids == self.config.image_token_id).flatten()
            starts = torch.nonzero(ids == self.config.vision_start_token_id).flatten()
            offsets = (
                torch.cat([mm[:, -4:-1] for mm in multimodal_embeddings]).to(device).round().long()
            )
            tokens = media[media >= num_computed_tokens][: offsets.shape[0]]
            if tokens.shape[0] != offsets.shape[0]:
                raise RuntimeError(
                    f"{offsets.shape[0]} image embeddings but {tokens.shape[0]} image tokens from "
                    f"token {num_computed_tokens} on: the processor and the model disagree on the "
                    "kept counts"
                )
            start = starts[torch.searchsorted(starts, tokens) - 1]  # each token's <|vision_start|>
            positions[:, tokens] = (offsets + positions[0, start].unsqueeze(1) + 1).T.to(
                positions.dtype
            )
        n = int(input_ids.numel()) if isinstance(input_ids, torch.Tensor) else len(input_ids)
        delta = int(positions[:, :n].max()) + 1 - n if n else 0
        return out, positions, delta

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: Any = None,
        *,
        is_multimodal: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM's embedding of a step's tokens; with proportional attention, each survivor's
        ``log(size)`` (the last column `embed_multimodal` gave it) is first taken off and
        written to `LogSizes` at its token, zeros elsewhere, for the attention layers of the
        step that follows."""
        if self.lightkv_log_sizes is None:
            return super().embed_input_ids(
                input_ids, multimodal_embeddings, is_multimodal=is_multimodal
            )
        logs = None
        if multimodal_embeddings is not None and len(multimodal_embeddings) > 0:
            logs = torch.cat([mm[:, -1] for mm in multimodal_embeddings]).float()
            multimodal_embeddings = [mm[:, :-1] for mm in multimodal_embeddings]
        self.lightkv_log_sizes.write(is_multimodal, logs)
        return super().embed_input_ids(
            input_ids, multimodal_embeddings, is_multimodal=is_multimodal
        )

    def embed_multimodal(self, **kwargs: object) -> tuple[torch.Tensor, ...]:
        """Per image: the survivors' embeddings ``[k, D]`` with four position channels
        appended (``[k, D + 4]``, vLLM's layout for pruned media): ``(0, row, col)``, each
        survivor's original M-RoPE offsets inside the image, and ``max(rows, cols)``, where
        the text after the image starts. With proportional attention a column of
        ``log(size)`` comes before them (``[k, D + 5]``; `embed_input_ids` takes it off)."""
        question = kwargs.pop(QUESTION_FIELD, None)
        inputs = self._parse_and_validate_multimodal_inputs(**kwargs)
        if inputs.get("video") is not None:
            raise ValueError(
                "lightkv's vLLM plugin compresses images only: a video reached the model"
            )
        image = inputs.get("image")
        if image is None:
            return ()
        embeds = self._process_image_input(image)
        merge = self.visual.spatial_merge_size
        grids = [(int(h) // merge, int(w) // merge) for _, h, w in image["image_grid_thw"].tolist()]
        ids = texts = None
        if self.lightkv_plan.reads_prompt:  # the question's input embeddings, as lightkv's adapters
            ids = [i.to(embeds[0].device) for i in question_list(question, len(grids))]
            texts = [self.language_model.embed_input_ids(i) for i in ids]
        selections = self.lightkv_plan.select(
            list(embeds), grids, questions=texts, question_ids=ids
        )
        out = []
        for sel, (rows, cols) in zip(selections, grids):
            dtype, device = sel.embeds.dtype, sel.embeds.device
            if (
                max(rows, cols) > 2 / torch.finfo(dtype).eps
            ):  # integers stay exact up to 2^(mantissa + 1)
                raise ValueError(
                    f"a {rows} x {cols}-token image: its positions are not exact in {dtype} (vLLM "
                    "carries them beside the embeddings); serve in float32 or limit the image size"
                    " (max_pixels)"
                )
            index = sel.index.to(device)
            positions = torch.stack(
                [
                    torch.zeros_like(index),
                    index // cols,
                    index % cols,
                    torch.full_like(index, max(rows, cols)),
                ],
                dim=1,
            )
            parts = [sel.embeds]
            if self.lightkv_log_sizes is not None:
                parts.append(log_sizes(sel.sizes, torch.float32).to(device, dtype)[:, None])
            out.append(torch.cat([*parts, positions.to(dtype)], dim=1))
        return tuple(out)
