"""lightkv's vLLM plugin on a tiny random Qwen2.5-VL, vLLM's engine in one process (CPU).

Each engine runs once per session (see conftest); the tests read what it did:

(a) a ratio-0 pipeline gives exactly stock vLLM's tokens, prompt lengths and KV blocks;
(b) the prompt length and vLLM's own KV block count shrink as promised;
(c) the kept set and merged embeddings equal lightkv's `Stage` on the same encoder output,
    run outside vLLM;
(d) a batch of prompts with different image sizes (two images, none) equals each prompt
    alone, and prefilling in chunks changes nothing;
(e) clear refusals: unsupported pipelines, relevance from layer 0's queries and keys, LLaVA,
    a stock architecture with a pipeline, videos, a vLLM release outside the declared range.
    Proportional attention is served (tests/vllm/test_proportional.py).
"""

from __future__ import annotations

import math

import pytest
import torch

import lightkv
from lightkv import ImageSegment, VisionLayout
from lightkv.config import PipelineConfig
from lightkv.policies.counts import kept_count

from .conftest import QWEN, tiny

PROMPTS = [
    {"images": [[16, 16]], "seed": 0},
    {"images": [[4, 6]], "seed": 1},
    {"images": [[6, 10], [8, 4]], "seed": 2},
    {"images": [], "seed": 3},
    {"images": [[12, 7]], "seed": 4},
]
MAX_TOKENS = 6
RATIO0 = {
    "name": "ratio-0",
    "schedule": {"name": "pre_llm", "params": {"removal_ratio": 0.0}},
    "relevance": "uniform",
}
MERGE = {  # LightKV's windowed merging before the LLM, prompt-agnostic
    "name": "windowed-merge",
    "schedule": {"name": "pre_llm", "params": {"removal_ratio": 0.5, "windows_per_side": 2}},
    "partitioner": "grid",
    "scorer": "cosine",
    "pruner": "divergence",
    "passer": "relevance_mean",
    "relevance": "uniform",
}
DIVPRUNE_RATIO = 1 - 128 / 576


def run(engine, arch=QWEN, pipeline=None):
    """One engine per (arch, pipeline): the batch, then each prompt alone, then a video."""
    return engine(
        arch=arch, pipeline=pipeline, prompts=PROMPTS, max_tokens=MAX_TOKENS, alone=True, video=True
    )


def stock(engine):
    return ok(engine(arch=None, pipeline=None, prompts=PROMPTS, max_tokens=MAX_TOKENS))


def ok(result):
    assert "error" not in result, result["error"]["trace"]
    return result


def blocks(prompt_len, block_size):
    return math.ceil((prompt_len + MAX_TOKENS - 1) / block_size)


def test_stock_engine_runs_and_counts_blocks(engine):
    base = stock(engine)
    for out in base["outputs"]:
        assert len(out["tokens"]) == MAX_TOKENS
        assert out["blocks"] == blocks(out["prompt_len"], base["block_size"])
        assert len(out["positions"]) == 3 and len(out["positions"][0]) == out["prompt_len"]


def test_ratio_zero_is_stock_vllm(engine):
    base = stock(engine)
    same = ok(run(engine, pipeline=RATIO0))
    assert same["outputs"] == base["outputs"]  # tokens, prompts, KV blocks and M-RoPE positions


@pytest.mark.parametrize("pipeline", ["divprune"])
def test_prompt_and_kv_blocks_shrink_as_promised(engine, pipeline):
    base = stock(engine)
    pruned = ok(run(engine, pipeline=pipeline))
    for prompt, s, p in zip(PROMPTS, base["outputs"], pruned["outputs"]):
        removed = sum(
            r * c - int(kept_count(torch.tensor(r * c), DIVPRUNE_RATIO))
            for r, c in prompt["images"]
        )
        assert p["prompt_len"] == s["prompt_len"] - removed
        assert p["blocks"] == blocks(p["prompt_len"], pruned["block_size"])
    assert pruned["outputs"][0]["prompt_len"] == base["outputs"][0]["prompt_len"] - (256 - 57)
    assert pruned["outputs"][0]["blocks"] < base["outputs"][0]["blocks"]
    assert sum(p["blocks"] for p in pruned["outputs"]) < sum(s["blocks"] for s in base["outputs"])
    assert pruned["outputs"][3] == base["outputs"][3]  # text only: untouched


@pytest.mark.parametrize("pipeline", ["divprune", MERGE], ids=["divprune", "merge"])
def test_survivors_and_text_keep_their_stock_positions(engine, pipeline):
    """lightkv's promise, now inside vLLM: every text token has the M-RoPE position it has in
    stock vLLM, and every kept image token one of its image's stock positions, in order."""
    base, pruned = stock(engine), ok(run(engine, pipeline=pipeline))
    image_pad = tiny.vocab()["<|image_pad|>"]
    for s, p in zip(base["outputs"], pruned["outputs"]):
        s_pos, p_pos = torch.tensor(s["positions"]).T, torch.tensor(p["positions"]).T  # [N, 3]
        s_img, p_img = (
            torch.tensor(s["prompt"]) == image_pad,
            torch.tensor(p["prompt"]) == image_pad,
        )
        assert torch.equal(s_pos[~s_img], p_pos[~p_img])  # text: the same positions
        stock_rows = {tuple(x) for x in s_pos[s_img].tolist()}
        kept = [tuple(x) for x in p_pos[p_img].tolist()]
        assert set(kept) <= stock_rows and len(set(kept)) == len(kept)
        assert p_img.sum() < s_img.sum() or s_img.sum() == 0


def _stage_outside_vllm(spec):
    pipe = lightkv.load(spec) if isinstance(spec, str) else PipelineConfig.from_dict(spec).build()
    return pipe.stages(2)[0]


@pytest.mark.parametrize(
    "pipeline", ["divprune", "downsample", MERGE], ids=["divprune", "downsample", "merge"]
)
def test_kept_set_is_lightkv_stage_on_the_same_embeddings(engine, pipeline):
    result = ok(run(engine, pipeline=pipeline))
    stage = _stage_outside_vllm(pipeline)
    images = [tuple(g) for p in PROMPTS for g in p["images"]]
    assert len(result["records"]) == len(images)
    for rec in result["records"]:
        _, h, w = rec["grid"]
        rows, cols = h // 2, w // 2
        encoder = torch.tensor(rec["encoder"])
        layout = VisionLayout.from_segments(
            1, rows * cols, [ImageSegment(row=0, offset=0, grid=(rows, cols))]
        )
        out = stage(encoder[None], layout)
        served = torch.tensor(rec["embeds"])
        t, r, c = served[:, -4].long(), served[:, -3].long(), served[:, -2].long()
        assert (t == 0).all() and (served[:, -1].long() == max(rows, cols)).all()
        assert (r * cols + c).tolist() == out.kept_index[0].tolist()
        torch.testing.assert_close(served[:, :-4], out.hidden[0], rtol=1e-5, atol=1e-6)
        assert 0 < served.shape[0] < rows * cols or rows * cols == 1


def test_batch_of_image_sizes_equals_each_prompt_alone(engine):
    pruned = ok(run(engine, pipeline="divprune"))
    assert [o["tokens"] for o in pruned["outputs"]] == pruned["alone"]
    lens = [o["prompt_len"] for o in pruned["outputs"]]
    assert len(set(lens)) == len(lens)  # every prompt its own length, in one batch


def test_chunked_prefill_gives_the_same_tokens_and_positions(engine):
    """Prompts prefilled in chunks of 32 tokens (an image split across chunks: vLLM rewrites
    the positions chunk by chunk) run exactly as in one piece."""
    whole = ok(run(engine, pipeline="divprune"))
    chunked = ok(
        engine(arch=QWEN, pipeline="divprune", prompts=PROMPTS, max_tokens=MAX_TOKENS, chunk=32)
    )
    for a, b in zip(whole["outputs"], chunked["outputs"]):
        assert (a["tokens"], a["positions"], a["prompt_len"]) == (
            b["tokens"],
            b["positions"],
            b["prompt_len"],
        )


def test_a_video_is_refused(engine):
    pruned = ok(run(engine, pipeline="divprune"))
    assert pruned["video_error"] is not None
    assert "images only" in pruned["video_error"]["message"]


@pytest.mark.parametrize(
    "arch, pipeline, words",
    [
        (QWEN, "lightkv-pre-llm", ["prompt-aware", "relevance: uniform"]),
        (
            "LightKVLlavaForConditionalGeneration",
            "divprune",
            ["does not compress LLaVA-1.5", "Qwen2.5-VL"],
        ),
        (None, "divprune", ["stock model", "uncompressed", QWEN]),
    ],
    ids=["queries-and-keys", "llava", "stock-arch-with-pipeline"],
)
def test_clear_refusals(engine, arch, pipeline, words):
    """One engine per path a refusal takes (the plan, a refused architecture, the runner's
    check); every pipeline refusal's message is checked without vLLM in tests/test_vllm_plan.py."""
    result = engine(arch=arch, pipeline=pipeline, prompts=PROMPTS[:1], max_tokens=2)
    assert "error" in result, "expected a refusal, the engine ran"
    for word in words:
        assert word in result["error"]["message"], result["error"]["message"]


def test_a_lightkv_architecture_without_a_pipeline_is_refused():
    import types

    from lightkv.integrations.vllm.qwen2_5_vl import plan_for

    with pytest.raises(ValueError, match="names no lightkv pipeline"):
        plan_for(types.SimpleNamespace(text_config=types.SimpleNamespace(num_hidden_layers=2)))


def test_an_untested_vllm_version_is_refused(monkeypatch):
    import vllm

    from lightkv.integrations.vllm import TESTED_VLLM, check_version

    assert check_version().split("+")[0] in TESTED_VLLM
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    with pytest.raises(
        RuntimeError, match=r"supports vLLM 0.32.x and 0.33.x only \(tested: 0.32.0\), not 0.99.0"
    ):
        check_version()
