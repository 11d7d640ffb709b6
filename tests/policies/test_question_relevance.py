"""`Prompt` and `question_attention` (issue 24, item 4): a relevance policy that reads the
prompt's token ids, against a loop oracle, and through a session on a tiny model."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv import ImageSegment, VisionLayout
from lightkv.adapters import apply
from lightkv.policies import (
    ExplicitSchedule,
    Prompt,
    QuestionAttention,
    Relevance,
    TextQueryAttention,
)
from tests.strategies import batches


def _ids_for(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 16, (layout.batch_size, layout.seq_len), generator=gen)
    return torch.where(layout.vision_mask, torch.full_like(ids, 3), ids)


def _qk(layout, heads=4, kv_heads=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, n = layout.batch_size, layout.seq_len
    return (
        torch.randn(b, heads, n, d, generator=gen, dtype=torch.float64),
        torch.randn(b, kv_heads, n, d, generator=gen, dtype=torch.float64),
    )


@pytest.mark.parametrize("heads", ["sum", "mean", "max"])
@settings(max_examples=30, deadline=None)
@given(case=batches(), chosen=st.sets(st.integers(10, 15), max_size=4), seed=st.integers(0, 100))
def test_question_attention_against_a_loop(heads, case, chosen, seed):
    """Per row: the text tokens after the last vision token whose id is chosen (all of them
    when none is), each one's causal softmax row over valid keys, summed, then per head."""
    lay = case.layout
    ids = _ids_for(lay, seed)
    q, k = _qk(lay, seed=seed)
    pol = QuestionAttention(ids=tuple(sorted(chosen)) if chosen else None, heads=heads)
    xi = pol.score(q, k, lay, prompt=Prompt(ids))
    logits = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    for b in range(lay.batch_size):
        vision = [j for j in range(lay.seq_len) if lay.vision_mask[b, j]]
        last = max(vision, default=-1)
        question = [i for i in range(last + 1, lay.seq_len) if lay.text_mask[b, i]]
        rows = [i for i in question if not chosen or int(ids[b, i]) in chosen] or question
        total = torch.zeros(q.shape[1], lay.seq_len, dtype=torch.float64)
        for i in rows:
            seen = [j for j in range(lay.seq_len) if lay.valid_mask[b, j] and j <= i]
            total[:, seen] += torch.softmax(logits[b, :, i, seen], dim=-1)
        ref = {"sum": total.sum(0), "mean": total.mean(0), "max": total.max(0).values}[heads]
        ref = torch.where(lay.vision_mask[b], ref, torch.zeros_like(ref))
        torch.testing.assert_close(xi[b], ref, rtol=1e-10, atol=1e-12)


def test_whole_question_equals_causal_text_attention_when_the_image_comes_first():
    """Text before the image sees no vision token under the causal mask, so reading the
    whole question gives text_attention's ξ on vision tokens."""
    lay = VisionLayout.from_segments(
        2, 12, [ImageSegment(0, 2, (2, 3)), ImageSegment(1, 1, (3, 2))]
    )
    q, k = _qk(lay)
    ids = _ids_for(lay, 0)
    a = QuestionAttention().score(q, k, lay, prompt=Prompt(ids))
    b = TextQueryAttention(causal=True).score(q, k, lay)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_the_chosen_ids_change_the_relevance_and_exclude_removes_them():
    lay = VisionLayout.from_segments(1, 10, [ImageSegment(0, 1, (2, 2))])  # image 1-4, text 5-9
    q, k = _qk(lay, seed=3)
    ids = torch.tensor([[1, 3, 3, 3, 3, 4, 11, 12, 13, 14]])
    p = Prompt(ids)
    only = QuestionAttention(ids=(12,)).score(q, k, lay, prompt=p)
    everything = QuestionAttention().score(q, k, lay, prompt=p)
    assert not torch.allclose(only, everything)
    # excluding every other question id leaves exactly the rows of id 12
    assert torch.allclose(
        QuestionAttention(exclude=(4, 11, 13, 14)).score(q, k, lay, prompt=p), only
    )
    # ids that are not in the question fall back to the whole question
    assert torch.allclose(QuestionAttention(ids=(99,)).score(q, k, lay, prompt=p), everything)


def test_prompt_ids_follow_the_layout_and_errors_name_the_fix():
    lay = VisionLayout.from_segments(1, 8, [ImageSegment(0, 1, (2, 2))])
    p = Prompt(torch.tensor([[1, 3, 3, 3, 3, 4, 9, 7]]))
    assert p.ids(lay).tolist() == [[1, -1, -1, -1, -1, 4, 9, 7]]
    assert p.question_mask(lay).tolist() == [[False] * 5 + [True] * 3]
    with pytest.raises(ValueError, match="rows"):
        p.ids(VisionLayout.from_segments(2, 8, []))
    with pytest.raises(TypeError, match="integer"):
        Prompt(torch.zeros(1, 3))
    q, k = _qk(lay)
    with pytest.raises(ValueError, match="prompt=Prompt"):
        QuestionAttention().score(q, k, lay)


def test_a_session_gives_the_policy_the_prompt():
    """On a tiny LLaVA, through the model's own projections: question_attention (whole
    question) records the same ξ as causal text_attention on the rows with one image (row 1
    has text between two images, which only text_attention reads), and one id differs."""
    fam = TINY_MODELS["llava"]
    model = fam.build()
    batch = fam.collate(fam.examples(model))
    base = lightkv.load("lightkv")

    def xi(relevance):
        pipe = replace(
            base,
            relevance=relevance,
            scheduler=ExplicitSchedule(layers=(1,), removal_ratios=(0.25,), windows_per_side=(1,)),
        )
        with apply(pipe, model, record=True) as session:
            model(**batch)
        return session.last_prefill.stages[0].relevance

    whole = xi(QuestionAttention())
    text = xi(Relevance.create("text_attention"))
    assert int((batch["input_ids"][1] == model.config.image_token_id).sum()) > 0
    torch.testing.assert_close(whole[[0, 2]], text[[0, 2]], rtol=1e-5, atol=1e-7)
    assert not torch.allclose(whole[1], text[1])
    last_id = int(batch["input_ids"][0, -1])
    assert not torch.allclose(whole, xi(QuestionAttention(ids=(last_id,))))
