"""Proportional attention inside vLLM through the extra head channel (issue 49, item 2):
`lightkv-cover` as shipped (its bias on) gives in vLLM the greedy tokens and first-step
log-probabilities of `lightkv.apply` in `transformers` (the bias on the 4-D mask), on the same
encoder output; eager and compiled, in one prefill and in chunks, and from the prefix cache.
With every size 1 the channel changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import lightkv

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


def _check_against_transformers(result, model_dir, spec):
    """Each prompt's tokens equal transformers' and its first step's top log-probabilities
    agree to float32 rounding; returns transformers' first-step log-probabilities."""
    firsts = []
    for prompt, out in zip(ONE_IMAGE, result["outputs"]):
        question = reference.survivors(model_dir, spec, prompt)[0][0]
        encoder = [served(result, r, c, question)[2] for r, c in prompt["images"]]
        tokens, logp = reference.generate(model_dir, spec, prompt, encoder, STEPS)
        assert out["tokens"] == tokens
        top = out["logprobs"][0]
        assert len(top) >= 5
        for token, value in top.items():
            assert value == pytest.approx(float(logp[int(token)]), abs=2e-4)
        firsts.append(logp)
    return firsts


@pytest.mark.parametrize(
    "extra", [{}, {"chunk": 32}, {"eager": False}], ids=["eager", "chunked", "compiled"]
)
def test_cover_with_its_bias_equals_transformers(engine, model_dir, extra):
    result = ok(engine(arch=QWEN, pipeline=COVER, prompts=ONE_IMAGE, **ONE, **extra))
    with_bias = _check_against_transformers(result, model_dir, COVER)
    # the bias acts: without it transformers' log-probabilities move by more than the tolerance
    for prompt, logp in zip(ONE_IMAGE, with_bias):
        question = reference.survivors(model_dir, COVER, prompt)[0][0]
        encoder = [served(result, r, c, question)[2] for r, c in prompt["images"]]
        _, plain = reference.generate(model_dir, NO_BIAS, prompt, encoder, STEPS)
        assert (plain - logp).abs().max() > 1e-2


def test_the_bias_survives_the_prefix_cache(engine):
    """The same prompt twice, one after the other: the second reads the first's KV blocks
    (keys with their log-size channel) and decodes the same tokens."""
    twice = [ONE_IMAGE[0], ONE_IMAGE[0]]
    result = ok(
        engine(
            arch=QWEN, pipeline=COVER, prompts=twice, sequential=True, prefix_caching=True, **ONE
        )
    )
    first, second = result["outputs"]
    assert second["cached"] and second["cached"] > 0
    assert first["tokens"] == second["tokens"]


def test_sizes_of_one_change_nothing(engine):
    """DivPrune merges nothing: with proportional attention on, every log-size is 0 and the
    channel route serves the tokens and log-probabilities of the plain route."""
    divprune = yaml.safe_load(
        (Path(lightkv.__file__).parent / "methods" / "divprune.yaml").read_text()
    )
    on = ok(
        engine(
            arch=QWEN,
            pipeline={**divprune, "proportional_attention": True},
            prompts=ONE_IMAGE,
            **ONE,
        )
    )
    off = ok(engine(arch=QWEN, pipeline=divprune, prompts=ONE_IMAGE, **ONE))
    for a, b in zip(on["outputs"], off["outputs"]):
        assert a["tokens"] == b["tokens"]
        for step_a, step_b in zip(a["logprobs"], b["logprobs"]):
            assert step_a.keys() == step_b.keys()
            for token in step_a:
                assert step_a[token] == pytest.approx(step_b[token], abs=1e-5)
