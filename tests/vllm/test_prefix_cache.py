"""Prefix caching with compressed images: no request receives another's compressed KV.

vLLM keys a prefix-cache block by its tokens and, for a block holding image placeholders,
the image's multimodal hash; the plugin's hashes include the pipeline's fingerprint
(`LightKVQwen2_5_VLProcessor._get_mm_hashes`), and the plugin's selection depends on the
image and the pipeline alone (prompt-aware pipelines are refused), so a key covers all that
the cached KV depends on.
"""

from __future__ import annotations

import types

from lightkv.integrations.vllm.plan import PreLLMPlan
from lightkv.integrations.vllm.qwen2_5_vl import LightKVQwen2_5_VLProcessor

from .conftest import QWEN
from .test_plugin import ok

IMAGE = [[12, 10]]
SAME_IMAGE_TWO_QUESTIONS = [
    {"images": IMAGE, "image_seed": 7, "question": "w5 w6 w7 w8"},
    {"images": IMAGE, "image_seed": 7, "question": "w40 w41 w42 w43 w44 w45"},
    {"images": IMAGE, "image_seed": 7, "question": "w5 w6 w7 w8"},  # the first request again
]


def test_same_image_other_question_with_prefix_caching(engine):
    cached = ok(
        engine(
            arch=QWEN,
            pipeline="divprune",
            prompts=SAME_IMAGE_TWO_QUESTIONS,
            max_tokens=6,
            prefix_caching=True,
            sequential=True,
        )
    )
    # without prefix caching, in one batch (a batch equals each prompt alone: test_plugin)
    fresh = ok(
        engine(arch=QWEN, pipeline="divprune", prompts=SAME_IMAGE_TWO_QUESTIONS[:2], max_tokens=6)
    )["outputs"]
    first, other, again = cached["outputs"]
    # each request gets the tokens (and prompt) it gets alone without prefix caching
    assert (first["tokens"], first["prompt"]) == (fresh[0]["tokens"], fresh[0]["prompt"])
    assert (other["tokens"], other["prompt"]) == (fresh[1]["tokens"], fresh[1]["prompt"])
    assert first["cached"] == 0
    # the same request twice hits the cache (whole blocks of the compressed prompt) and decodes the same
    assert again["cached"] >= cached["block_size"] and again["tokens"] == first["tokens"]
    # the kept sets are lightkv's for this image, whether the encoder ran again or not
    kept = PreLLMPlan.load("divprune", num_layers=2).kept_count(12, 10)
    image_pad = 105
    assert all(o["prompt"].count(image_pad) == kept for o in cached["outputs"])


def test_multimodal_hashes_name_the_pipeline():
    """The hash vLLM keys caches with is computed over the image and the pipeline's fingerprint."""
    seen = []

    class Inputs:
        def get_mm_hashes(self, model_id, algorithm):
            seen.append(model_id)
            return {"image": [model_id]}

    def processor(pipeline):
        config = types.SimpleNamespace(
            lightkv=pipeline, text_config=types.SimpleNamespace(num_hidden_layers=2)
        )
        info = types.SimpleNamespace(
            model_id="tiny",
            get_hf_config=lambda: config,
            ctx=types.SimpleNamespace(
                get_mm_config=lambda: types.SimpleNamespace(mm_hasher_algorithm="blake3")
            ),
        )
        return types.SimpleNamespace(info=info)

    a = LightKVQwen2_5_VLProcessor._get_mm_hashes(processor("divprune"), Inputs())
    b = LightKVQwen2_5_VLProcessor._get_mm_hashes(processor("downsample"), Inputs())
    c = LightKVQwen2_5_VLProcessor._get_mm_hashes(processor("divprune"), Inputs())
    assert a == c != b
    assert seen[0] == f"tiny#lightkv:{PreLLMPlan.load('divprune', 2).fingerprint}"
