"""The question a prompt-aware pipeline reads inside vLLM, and the cache key that names it
(no vLLM needed).

lightkv's adapters give a pre-LLM stage the whole prompt; policies that read it
(`lightkv.integrations.vllm.plan.QUESTION_READERS`) read the *question*: the text after the
prompt's last image (`lightkv.policies.Prompt.question_mask`), as input embeddings. vLLM's
processor sees the whole prompt when a request arrives, so the plugin takes the question's
token ids there (`question_ids`), hands them to each image beside its pixels (the item field
`QUESTION_FIELD`), and names them in the image's multimodal hash (`question_tag`): the
encoder cache, the processor cache and the prefix cache then key a compressed image by the
image, the pipeline *and* the question. Chunked prefill does not matter: the question comes
from the processed prompt, not from the scheduled chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["QUESTION_FIELD", "question_ids", "question_list", "question_tag"]

QUESTION_FIELD = "lightkv_question"
"""The image item's field (``[T]`` int64 token ids) that carries its prompt's question."""


def question_ids(prompt: Sequence[int], image_token: int) -> list[int]:
    """The token ids after the prompt's last image token (all of them if it has none): the
    question as `lightkv.policies.Prompt.question_mask` reads it in Qwen2.5-VL, whose layout
    has no structural tokens (``<|vision_end|>`` and the chat template count as text)."""
    ids = [int(t) for t in prompt]
    last = max((i for i, t in enumerate(ids) if t == image_token), default=-1)
    return ids[last + 1 :]


def question_tag(ids: Sequence[int]) -> str:
    """A short hash of the question's token ids, for the multimodal hash."""
    data = ",".join(str(int(t)) for t in ids).encode("ascii")
    return hashlib.sha256(data).hexdigest()[:16]


def question_list(value: Any, count: int) -> list[torch.Tensor]:
    """Per image ``[T]`` token ids from the batched field (vLLM stacks equal lengths into a
    ``[B, T]`` tensor and leaves unequal ones a list).

    Raises:
        RuntimeError: the field is missing or does not hold one question per image.
    """
    if value is None:
        raise RuntimeError(
            "an image reached lightkv's prompt-aware pipeline without its question (the "
            f"{QUESTION_FIELD!r} field the plugin's processor adds): was it processed by "
            "LightKVQwen2_5_VLProcessor?"
        )
    rows = list(value) if isinstance(value, (list, tuple)) else list(value.unbind(0))
    if len(rows) != count:
        raise RuntimeError(f"{len(rows)} questions for {count} images")
    return [torch.as_tensor(r).reshape(-1).long() for r in rows]
