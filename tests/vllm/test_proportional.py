"""Proportional attention inside vLLM through the extra head channel (issue 49, item 2):
`lightkv-cover` as shipped (its bias on) gives in vLLM the greedy tokens and first-step
log-probabilities of `lightkv.apply` in `transformers` (the bias on the 4-D mask), on the same
encoder output; eager in 32-token chunks and from the prefix cache, and compiled. With every
size 1 the channel changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import lightkv
from lightkv.integrations.vllm.plan import PreLLMPlan

from . import reference
from .conftest import QWEN
from .test_plugin import ok
from .test_prompt_aware import ONE_IMAGE, served

COVER = yaml.safe_load(
    (Path(lightkv.__file__).parent / "methods" / "lightkv-cover.yaml").read_text()
)
NO_BIAS = {**COVER, "proportional_attention": False}
STEPS = 6
ONE = {"limits": {"image": 1}, "logprobs": 5, "max_tokens": STEPS}


def _check_against_transformers(result, model_dir, spec, prompts=ONE_IMAGE):
    """Each prompt's tokens equal transformers' and its first step's top log-probabilities
    agree to float32 rounding; returns transformers' first-step log-probabilities."""
    firsts = []
    reads = PreLLMPlan.load(spec, num_layers=2).reads_prompt  # else vLLM records no question
    for prompt, out in zip(prompts, result["outputs"], strict=True):
        question = reference.survivors(model_dir, spec, prompt)[0][0] if reads else None
        encoder = [served(result, r, c, question)[2] for r, c in prompt["images"]]
        tokens, logp = reference.generate(model_dir, spec, prompt, encoder, STEPS)
        assert out["tokens"] == tokens
        top = out["logprobs"][0]
        assert len(top) >= 5
        for token, value in top.items():
            assert value == pytest.approx(float(logp[int(token)]), abs=2e-4)
        firsts.append(logp)
    return firsts


# one engine per case: eager, prefilled in 32-token chunks and with the prefix cache on, the
# first prompt again at the end (served from the cache: keys with their log-size channel);
# and compiled (vLLM's default)
CASES = {
    "eager-chunked-prefix-cache": dict(chunk=32, prefix_caching=True, sequential=True),
    "compiled": dict(eager=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cover_with_its_bias_equals_transformers(engine, model_dir, case):
    prompts = ONE_IMAGE + [ONE_IMAGE[0]] if CASES[case].get("prefix_caching") else ONE_IMAGE
    result = ok(engine(arch=QWEN, pipeline=COVER, prompts=prompts, **ONE, **CASES[case]))
    with_bias = _check_against_transformers(result, model_dir, COVER, prompts)
    if CASES[case].get("prefix_caching"):
        again = result["outputs"][-1]
        assert again["cached"] and again["cached"] > 0
    # the bias acts: without it transformers' log-probabilities move by more than the tolerance
    for prompt, logp in zip(ONE_IMAGE, with_bias):
        question = reference.survivors(model_dir, COVER, prompt)[0][0]
        encoder = [served(result, r, c, question)[2] for r, c in prompt["images"]]
        _, plain = reference.generate(model_dir, NO_BIAS, prompt, encoder, STEPS)
        assert (plain - logp).abs().max() > 1e-2


def test_sizes_of_one_change_nothing(engine, model_dir):
    """DivPrune merges nothing: with proportional attention on, every log-size is 0, and vLLM's
    channel route serves what transformers serves without the bias."""
    divprune = yaml.safe_load(
        (Path(lightkv.__file__).parent / "methods" / "divprune.yaml").read_text()
    )
    on = {**divprune, "proportional_attention": True}
    result = ok(engine(arch=QWEN, pipeline=on, prompts=ONE_IMAGE, **ONE))
    _check_against_transformers(result, model_dir, divprune)
