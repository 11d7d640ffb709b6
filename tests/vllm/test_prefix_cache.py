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

from . import reference
from .conftest import QWEN
from .test_plugin import ok
from .test_prompt_aware import served

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
    # the same request twice hits the cache (whole blocks of the compressed prompt), same tokens
    assert again["cached"] >= cached["block_size"] and again["tokens"] == first["tokens"]
    # the kept sets are lightkv's for this image, whether the encoder ran again or not
    kept = PreLLMPlan.load("divprune", num_layers=2).kept_count(12, 10)
    image_pad = 105
    assert all(o["prompt"].count(image_pad) == kept for o in cached["outputs"])


def test_prompt_aware_prefix_caching_gives_each_question_its_selection(engine, model_dir):
    """CDPruner keeps other tokens of the same image under another question: with prefix
    caching on, each request gets the tokens and the selection it gets alone (lightkv.apply's),
    the second question shares no block that holds the image, and the first request again is
    served from the cache."""
    cached = ok(
        engine(
            arch=QWEN,
            pipeline="cdpruner",
            prompts=SAME_IMAGE_TWO_QUESTIONS,
            max_tokens=6,
            prefix_caching=True,
            sequential=True,
        )
    )
    fresh = ok(
        engine(arch=QWEN, pipeline="cdpruner", prompts=SAME_IMAGE_TWO_QUESTIONS[:2], max_tokens=6)
    )["outputs"]
    first, other, again = cached["outputs"]
    assert (first["tokens"], first["prompt"]) == (fresh[0]["tokens"], fresh[0]["prompt"])
    assert (other["tokens"], other["prompt"]) == (fresh[1]["tokens"], fresh[1]["prompt"])
    assert first["cached"] == 0 and other["cached"] == 0  # the image's blocks name the question
    assert again["cached"] >= cached["block_size"] and again["tokens"] == first["tokens"]
    selections = []
    for prompt in SAME_IMAGE_TWO_QUESTIONS[:2]:
        ((rows, cols),) = prompt["images"]
        question = reference.survivors(model_dir, "cdpruner", prompt)[0][0]
        index, _, encoder = served(cached, rows, cols, question)
        ((_, alone, _, _),) = reference.survivors(model_dir, "cdpruner", prompt, encoder=[encoder])
        assert index.tolist() == alone.tolist()  # lightkv.apply's selection for this request alone
        selections.append(index.tolist())
    assert selections[0] != selections[1]


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


def test_multimodal_hashes_name_the_question_of_a_prompt_aware_pipeline():
    """For CDPruner the hash names the question too (the token ids after the last image), and a
    client's ``multi_modal_uuids`` get the plugin's tag instead of standing for the image alone."""
    image_pad = 105

    class Inputs:
        def __init__(self, prompt, uuid=None):
            self.prompt, self.mm_uuid_items = prompt, {"image": [uuid]} if uuid else None
            self.uuid = uuid

        def get_mm_hashes(self, model_id, algorithm):
            return {"image": [self.uuid or model_id]}

    config = types.SimpleNamespace(
        lightkv="cdpruner",
        image_token_id=image_pad,
        text_config=types.SimpleNamespace(num_hidden_layers=2),
    )
    info = types.SimpleNamespace(
        model_id="tiny",
        get_hf_config=lambda: config,
        ctx=types.SimpleNamespace(
            get_mm_config=lambda: types.SimpleNamespace(mm_hasher_algorithm="blake3")
        ),
    )
    proc = types.SimpleNamespace(info=info)
    proc._prompt_ids = lambda prompt: LightKVQwen2_5_VLProcessor._prompt_ids(proc, prompt)

    def hashes(prompt, uuid=None):
        return LightKVQwen2_5_VLProcessor._get_mm_hashes(proc, Inputs(prompt, uuid))["image"][0]

    q1 = hashes([1, 103, image_pad, 104, 5, 6])
    assert q1 == hashes([7, 8, 103, image_pad, 104, 5, 6])  # text before the image: not read
    assert q1 != hashes([1, 103, image_pad, 104, 5, 7])
    assert hashes([1, image_pad, 5], uuid="mine") != hashes([1, image_pad, 6], uuid="mine")
    assert hashes([1, image_pad, 5], uuid="mine").startswith("mine#lightkv:")
