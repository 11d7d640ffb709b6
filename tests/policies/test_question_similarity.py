"""`question_similarity` (issue 41, cost): relevance from the hidden states the stage holds,
against a loop oracle written from the definition, and through sessions on tiny models."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv import ImageSegment, VisionLayout
from lightkv.adapters import apply
from lightkv.methods import QuestionSimilarity
from lightkv.policies import Prompt, Relevance
from lightkv.testing import check_policy
from tests.strategies import batches


def _ids(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 16, (layout.batch_size, layout.seq_len), generator=gen)
    return torch.where(layout.vision_mask, torch.full_like(ids, 3), ids)


def _oracle(hidden, layout, ids, floor):
    """Row by row, token by token: the mean cosine to the text after the last vision token,
    then (r - min + floor * range) / (range + floor * range) over the vision tokens."""
    out = torch.zeros(layout.batch_size, layout.seq_len, dtype=torch.float64)
    for b in range(layout.batch_size):
        vision = [j for j in range(layout.seq_len) if layout.vision_mask[b, j]]
        if not vision:
            continue
        question = [i for i in range(max(vision) + 1, layout.seq_len) if layout.text_mask[b, i]]
        if not question:
            out[b, vision] = 1.0
            continue
        r = {}
        for j in vision:
            sims = [
                float(torch.nn.functional.cosine_similarity(hidden[b, j], hidden[b, i], dim=0))
                for i in question
            ]
            r[j] = sum(sims) / len(sims)
        lo, hi = min(r.values()), max(r.values())
        for j in vision:
            out[b, j] = (
                1.0
                if hi - lo <= 1e-12
                else (r[j] - lo + floor * (hi - lo)) / ((hi - lo) * (1 + floor))
            )
    return out


@settings(max_examples=40, deadline=None)
@given(case=batches(), seed=st.integers(0, 1000), floor=st.sampled_from([1e-3, 0.1, 1.0]))
def test_against_a_loop(case, seed, floor):
    lay = case.layout
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(lay.batch_size, lay.seq_len, 6, generator=gen, dtype=torch.float64)
    ids = _ids(lay, seed)
    xi = QuestionSimilarity(floor=floor).score(None, None, lay, prompt=Prompt(ids), hidden=hidden)
    assert xi.dtype == torch.float64
    torch.testing.assert_close(xi, _oracle(hidden, lay, ids, floor), rtol=1e-9, atol=1e-12)
    # ξ in (0, 1] on vision tokens, the most similar token at 1 (or all at 1)
    for b in range(lay.batch_size):
        v = xi[b][lay.vision_mask[b]]
        if v.numel():
            assert float(v.min()) > 0 and float(v.max()) == 1.0


def test_the_question_decides_which_token_is_most_relevant():
    """Two image tokens aligned with two different words: asking for one word ranks its token
    first, asking for the other ranks the other first (the direction can go either way)."""
    lay = VisionLayout.from_segments(1, 7, [ImageSegment(0, 1, (1, 3))])  # image 1-3, text 4-6
    e = torch.eye(4, dtype=torch.float64)
    base = torch.stack(
        [e[3], e[0], e[1], e[2], e[3], e[3], e[3]]
    )  # token 1 ~ word 0, token 2 ~ word 1
    for word, winner in ((0, 1), (1, 2)):
        hidden = base.clone()
        hidden[5] = e[word]  # the question's content word
        xi = QuestionSimilarity().score(
            None,
            None,
            lay,
            prompt=Prompt(torch.tensor([[9, 3, 3, 3, 9, 9, 9]])),
            hidden=hidden[None],
        )
        assert int(xi[0, 1:4].argmax()) + 1 == winner


def test_flat_or_missing_question_is_uniform_and_errors_name_the_fix():
    lay = VisionLayout.from_segments(1, 6, [ImageSegment(0, 2, (2, 2))])  # no text after the image
    hidden = torch.randn(1, 6, 4)
    xi = QuestionSimilarity().score(
        None, None, lay, prompt=Prompt(torch.tensor([[1, 2, 3, 3, 3, 3]])), hidden=hidden
    )
    assert xi[0, 2:].tolist() == [1.0] * 4 and xi[0, :2].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="hidden=.*prompt=Prompt"):
        QuestionSimilarity().score(None, None, lay)
    with pytest.raises(ValueError, match="floor"):
        QuestionSimilarity(floor=0)
    check_policy(QuestionSimilarity)


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_a_session_reads_the_stage_hidden_states(family):
    """Before the LLM the policy reads the input embeddings: the ξ a session records equals
    the policy on the embeddings of the same batch, and the prefill counts no projection."""
    fam = TINY_MODELS[family]
    model = fam.build()
    batch = fam.collate(fam.examples(model))
    pipe = replace(lightkv.load("lightkv-cover"), relevance=Relevance.create("question_similarity"))
    with apply(pipe, model, record=True) as session:
        model(**batch)
    stage = session.last_prefill.stages[0]
    expected = QuestionSimilarity().score(
        None, None, stage.layout, prompt=Prompt(batch["input_ids"]), hidden=stage.hidden
    )
    torch.testing.assert_close(stage.relevance, expected.float())
    assert session.last_prefill.relevance_flops > 0
