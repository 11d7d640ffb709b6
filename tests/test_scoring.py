"""Teacher-forced fidelity scoring: exact where it must be, equal to real generation, and a
paired bootstrap that brackets what it estimates."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("sklearn")

from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.bench.quality import ablation_pipeline
from lightkv_lab.tasks import evaluate as ev
from lightkv_lab.tasks import model as dg
from lightkv_lab.tasks import scoring as sc


@pytest.fixture(scope="module")
def digitgrid():
    return dg.load("digitgrid")


@pytest.fixture(scope="module")
def convs(digitgrid):
    _, _, grid = digitgrid
    return sc.conversations(24, grid, seed=5)


@pytest.fixture(scope="module")
def uncompressed(digitgrid, convs):
    model, _, grid = digitgrid
    return sc.score(model, convs, grid, None, batch=12)


def test_identity_scores_equal_the_unhooked_model_exactly(digitgrid, convs, uncompressed):
    model, _, grid = digitgrid
    again = sc.score(model, convs, grid, None, batch=24)  # other batches, same rows
    assert sc.kl(uncompressed, again).abs().max() < 1e-6
    same = sc.score(model, convs, grid, None, batch=12)
    assert torch.equal(sc.kl(uncompressed, same), torch.zeros(len(convs), dtype=torch.float64))
    assert torch.equal(
        sc.kl(uncompressed, same, followup=True), torch.zeros(len(convs), dtype=torch.float64)
    )
    # the uncompressed log-probabilities are the plain model's, without any session
    data = dg.read_task("digitgrid").data
    c = convs[0]
    alone = sc.score(model, [c], grid, None, batch=1)
    prompt = data.collate([c.first], 256)
    with torch.no_grad():
        logits = model(input_ids=prompt["input_ids"], pixel_values=prompt["pixel_values"]).logits[0]
    n_answer = len(c.first.answer) + 1
    plain = logits[-n_answer - 1 : -1].float().log_softmax(-1)
    assert torch.allclose(plain.double(), alone.logprobs[0], atol=1e-4)
    assert torch.equal(plain.argmax(-1), alone.logprobs[0].argmax(-1))


def test_forced_exact_match_equals_greedy_generation(digitgrid, convs, uncompressed):
    model, _, grid = digitgrid
    firsts = [c.first for c in convs]
    for pipe in (None, knob_pipeline("random", 6, 0.25)[0]):
        gen = ev.evaluate(model, firsts, grid, pipe, batch=12)
        forced = uncompressed if pipe is None else sc.score(model, convs, grid, pipe, batch=12)
        greedy_right = torch.tensor([a == e.answer for a, e in zip(gen.answers, firsts)])
        assert torch.equal(greedy_right, forced.correct)
        assert forced.kept_fraction == pytest.approx(gen.kept_fraction)


def test_followups_are_about_another_region(convs):
    for c in convs:
        assert c.followup.qtype == "what" and c.followup.image is c.first.image
        if "row" in c.first.meta:
            far = max(
                abs(c.followup.meta["row"] - c.first.meta["row"]),
                abs(c.followup.meta["col"] - c.first.meta["col"]),
            )
            assert far >= 1


def test_compression_costs_probability_and_kl_is_positive(digitgrid, convs, uncompressed):
    model, _, grid = digitgrid
    pipe, _ = knob_pipeline("random", 6, 0.25)
    res = sc.score(model, convs, grid, pipe, batch=12)
    k = sc.kl(uncompressed, res)
    assert bool((k >= 0).all()) and float(k.mean()) > 0
    assert res.kept_fraction < 0.5


def test_ablations_swap_one_part():
    pipe, _ = ablation_pipeline("random merge", 6)
    base, _ = knob_pipeline("lightkv", 6, 0.55)
    assert type(pipe.scorer).__name__ == "RandomDivergence"
    assert (pipe.partitioner, pipe.pruner, pipe.passer, pipe.relevance, pipe.scheduler) == (
        base.partitioner,
        base.pruner,
        base.passer,
        base.relevance,
        base.scheduler,
    )


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=40), st.floats(-2, 2))
def test_paired_bootstrap_brackets_the_mean(values, shift):
    x = torch.tensor(values, dtype=torch.float64)
    y = x - shift  # a constant paired difference: the interval has no width
    mean, lo, hi = sc.paired_bootstrap(x, y, n_boot=200)
    assert mean == pytest.approx(shift, abs=1e-9) and lo == pytest.approx(shift, abs=1e-9)
    assert hi == pytest.approx(shift, abs=1e-9)
    noisy = y + torch.linspace(-1, 1, len(values), dtype=torch.float64)
    m2, lo2, hi2 = sc.paired_bootstrap(x, noisy, n_boot=200)
    assert lo2 <= m2 + 1e-9 and m2 <= hi2 + 1e-9


def test_bootstrap_and_kl_refuse_mismatched_inputs(uncompressed):
    with pytest.raises(ValueError, match="one length"):
        sc.paired_bootstrap(torch.zeros(3), torch.zeros(4))
    short = sc.ScoreResult(
        qtypes=[], correct=torch.zeros(0, dtype=torch.bool), logp=torch.zeros(0), logprobs=[]
    )
    with pytest.raises(ValueError, match="same conversations"):
        sc.kl(uncompressed, short)
