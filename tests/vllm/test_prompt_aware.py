"""Prompt-aware selection inside vLLM (CDPruner, lightkv-cover): the survivors of every
image equal what `lightkv.apply` keeps in `transformers` on the same model and inputs
(exact sets), each request with its own question, also when prefilled in chunks that put
the question after the image's chunk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import lightkv

from . import reference
from .conftest import QWEN
from .test_plugin import ok

COVER = {  # the preset, less proportional attention (vLLM's kernels cannot weight keys)
    **yaml.safe_load(
        (Path(lightkv.__file__).parent / "methods" / "lightkv-cover.yaml").read_text()
    ),
    "proportional_attention": False,
}
PROMPTS = [
    {"images": [[12, 10]], "image_seed": 7, "question": "w5 w6 w7 w8"},
    {"images": [[12, 10]], "image_seed": 7, "question": "w40 w41 w42 w43 w44 w45"},
    {"images": [[8, 6]], "image_seed": 3, "question": "w9 w10"},
    {"images": [[6, 10], [8, 4]], "seed": 2},  # two images, the question after the second
]
CASES = [("cdpruner", None), ("cdpruner", 32), (COVER, 32)]
ONE_IMAGE = [p for p in PROMPTS if len(p["images"]) == 1]
"""lightkv-cover relates the images of a prompt (relevance scaled over all of them), so vLLM
serves it one image per prompt."""


def served(result, rows, cols, question):
    """The survivors vLLM served for the image of this grid and question: grid indices and
    embeddings (`embed_multimodal`'s output less its position channels)."""
    found = [
        r
        for r in result["records"]
        if r["grid"][1:] == [2 * rows, 2 * cols] and r["question"] == question
    ]
    assert found, f"no record for {rows}x{cols} and {question}"
    rec = found[0]  # an image encoded again (an encoder cache miss) gives the same result
    assert all(r["embeds"] == rec["embeds"] for r in found)
    e = torch.tensor(rec["embeds"])
    index = e[:, -3].long() * cols + e[:, -2].long()
    return index, e[:, :-4], torch.tensor(rec["encoder"])


@pytest.mark.parametrize(
    "pipeline, chunk", CASES, ids=["cdpruner", "cdpruner-chunked", "cover-chunked"]
)
def test_survivors_equal_lightkv_apply(engine, model_dir, pipeline, chunk):
    one = {"limits": {"image": 1}}
    prompts, extra = (PROMPTS, {}) if pipeline == "cdpruner" else (ONE_IMAGE, one)
    if chunk:
        extra["chunk"] = chunk
    result = ok(engine(arch=QWEN, pipeline=pipeline, prompts=prompts, max_tokens=4, **extra))
    kept = {}
    for n, prompt in enumerate(prompts):
        first = reference.survivors(model_dir, pipeline, prompt)  # the model's own encoder
        encoder = [
            served(result, r, c, first[0][0])[2] for r, c in prompt["images"]
        ]  # vLLM's encoder output: the same inputs
        ref = reference.survivors(model_dir, pipeline, prompt, encoder=encoder)
        for (rows, cols), (question, index, embeds, own), vllm_encoder in zip(
            prompt["images"], ref, encoder
        ):
            torch.testing.assert_close(own, vllm_encoder, rtol=1e-4, atol=1e-5)  # one model
            got, got_embeds, _ = served(result, rows, cols, question)
            assert got.tolist() == index.tolist()  # exact sets, in grid order
            # merged embeddings: float32 rounding of a weighted mean (lightkv-cover), ~1e-5
            torch.testing.assert_close(got_embeds, embeds, rtol=1e-4, atol=1e-4)
            assert 0 < got.numel() < rows * cols
            kept[n, rows, cols] = got.tolist()
    if pipeline == "cdpruner":  # the same image under two questions: two selections
        assert kept[0, 12, 10] != kept[1, 12, 10]


def test_chunked_prefill_gives_the_same_tokens(engine):
    """The question is read from the processed prompt, not from the scheduled chunk: chunks of
    32 tokens (the image in one, its question in the next) change nothing."""
    whole = ok(engine(arch=QWEN, pipeline="cdpruner", prompts=PROMPTS, max_tokens=4))
    chunked = ok(engine(arch=QWEN, pipeline="cdpruner", prompts=PROMPTS, max_tokens=4, chunk=32))
    for a, b in zip(whole["outputs"], chunked["outputs"]):
        assert (a["tokens"], a["positions"], a["prompt_len"]) == (
            b["tokens"],
            b["positions"],
            b["prompt_len"],
        )


def test_a_pipeline_that_relates_images_needs_one_image_per_prompt(engine):
    """lightkv-cover's selection of an image depends on the prompt's other images, which vLLM
    encodes on their own: refused at load unless prompts hold one image."""
    result = engine(arch=QWEN, pipeline=COVER, prompts=ONE_IMAGE[:1], max_tokens=2)
    assert "error" in result, "expected a refusal, the engine ran"
    message = result["error"]["message"]
    assert "relates the images of a prompt" in message, message
    assert "limit_mm_per_prompt={'image': 1}" in message, message


def test_the_question_travels_to_the_engine_core_process(engine):
    """With the engine core in its own process (vLLM's default) the question field crosses
    vLLM's IPC with its image, also for an image the processor cache sends only by hash (the
    first prompt twice), and every request decodes as in one process."""
    prompts = PROMPTS + PROMPTS[:1]
    one = ok(engine(arch=QWEN, pipeline="cdpruner", prompts=prompts, max_tokens=4))
    two = ok(
        engine(arch=QWEN, pipeline="cdpruner", prompts=prompts, max_tokens=4, multiprocessing=True)
    )
    assert [o["tokens"] for o in two["outputs"]] == [o["tokens"] for o in one["outputs"]]
    assert [o["prompt"] for o in two["outputs"]] == [o["prompt"] for o in one["outputs"]]
    assert one["outputs"][-1]["tokens"] == one["outputs"][0]["tokens"]
