"""The 2026 presets ``tops``, ``eadp`` and ``era``: each loads, runs a tiny LLaVA session at
the library's knob, runs (or refuses in one line) on every tiny family, and keeps the tokens
its rule says.

EADP's authors released code: its kept sets are checked against their code's in
``test_authors_fixtures.py``. TOPS and ERA have no released code: their selection rules are
checked here against oracles written from the docs pages' statements (plain Python loops on
small windows), and ERA's saliency-weighted sizes against their definition.
"""

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
from lightkv.graph.provenance import Provenance
from lightkv.methods.eadp import EADP, facility_location
from lightkv.methods.era import ERA, SaliencySizes
from lightkv.methods.tops import TOPS
from lightkv.policies import Prompt
from lightkv.stage import Stage
from lightkv.testing import TINY_LLAVA
from tests.methods import recipes as R

NAMES = ("tops", "eadp", "era")


@pytest.fixture(scope="module")
def llava():
    model = TINY_LLAVA.build(image_size=96, patch_size=4, hidden_size=32, intermediate_size=64)
    batch = TINY_LLAVA.collate([TINY_LLAVA.row(model, images=1, seed=0)])
    return model, batch


@pytest.mark.parametrize("name", NAMES)
def test_loads_and_runs_a_tiny_llava_session_at_the_knob(llava, name):
    model, batch = llava
    pipe = lightkv.load(name, kept_fraction=0.11)
    assert lightkv.load(name).name == name
    with lightkv.apply(pipe, model) as session, torch.no_grad():
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    report = session.report()
    assert out.shape[1] == batch["input_ids"].shape[1] + 3
    assert abs(report.kept_vision_fraction - 0.11) <= 0.01
    assert [(s.spec.mode, s.spec.layer) for s in session.stages] == [("pre_llm", 0)]


@pytest.mark.parametrize("family", list(TINY_MODELS))
@pytest.mark.parametrize("name", NAMES)
def test_runs_on_every_family_or_refuses_in_one_line(family, name):
    fam = TINY_MODELS[family]
    model = fam.build()
    batch = fam.collate(fam.examples(model))
    pipe = lightkv.load(name, kept_fraction=0.22)
    if family == "qwen3_vl":  # visual features enter its first layers: nothing may leave before
        with pytest.raises(NotImplementedError, match="DeepStack") as e:
            lightkv.apply(pipe, model, **fam.adapter_options)
        assert "\n" not in str(e.value)
        return
    with lightkv.apply(pipe, model, **fam.adapter_options) as session, torch.no_grad():
        out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape[1] >= batch["input_ids"].shape[1] + 1
    assert session.report().kept_vision_fraction < 0.5


@pytest.mark.parametrize("name", ["tops", "era"])  # eadp: no question there, as cdpruner
def test_a_cache_placement_is_refused_naming_what_it_reads(llava, name):
    model, batch = llava
    pipe = replace(lightkv.load(name), placement="cache")
    with pytest.raises(ValueError) as e:
        with lightkv.apply(pipe, model), torch.no_grad():
            model(**batch)
    msg = str(e.value)
    assert "\n" not in msg and ("prompt" in msg or "question" in msg), msg


def test_eadp_without_a_question_is_plain_facility_location():
    n = 256
    t = R.draw(0, n, [["hidden", ["S", 16]]])
    st_ = lightkv.load("eadp").stages(32)[0]
    got = R.image_kept(st_(t["hidden"].unsqueeze(0), R.layout(n), None, None, None, None)
                       .kept_index, n)  # fmt: skip
    x = t["hidden"][R.BEFORE : R.BEFORE + n]
    x = x / x.norm(dim=-1, keepdim=True)
    sim = (0.5 * ((x @ x.T).clamp(-1, 1) + 1)).unsqueeze(0)
    k = n - int(st_.spec.removal_ratio * n + 1e-9)
    want = facility_location(sim, torch.ones(1, n), torch.ones(1, n, dtype=torch.bool),
                             torch.tensor([k]))  # fmt: skip
    assert got == sorted(torch.nonzero(want[0]).flatten().tolist())


# ---- small windows: a layout of one image of g x g tokens, question tokens after it ----


def small(seed: int, g: int, d: int = 6, q: int = 3):
    """``(hidden [1, S, d], layout, prompt)`` for one image of ``g x g`` tokens after 2 text
    tokens and ``q`` question tokens after it."""
    n, s = g * g, 2 + g * g + q
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, s, d, generator=gen, dtype=torch.float64)
    layout = VisionLayout.from_segments(1, s, [ImageSegment(row=0, offset=2, grid=(g, g))])
    return hidden, layout, Prompt(torch.arange(s).unsqueeze(0)), n


def run_stage(pruner, passer, relevance, hidden, layout, prompt, kept):
    n = int(layout.vision_mask.sum())
    spec = lightkv.load("divprune").stages(32)[0].spec
    base = lightkv.load("era").stages(32)[0] if passer is not None else None
    stage = Stage(
        spec=replace(spec, removal_ratio=1 - kept / n),
        partitioner=lightkv.load("divprune").partitioner,
        scorer=base.scorer if base else None,
        pruner=pruner,
        passer=passer or lightkv.load("divprune").passer,
        relevance=lightkv.load("divprune").relevance,
    )
    xi = torch.zeros(1, hidden.shape[1], dtype=hidden.dtype)
    xi[layout.vision_mask] = relevance
    return stage(hidden, layout, xi, None, None, prompt)


def image_kept(res, n: int) -> list[int]:
    idx = res.kept_index[0]
    return sorted((idx[(idx >= 2) & (idx < 2 + n)] - 2).tolist())


def unit(v):
    norm = math.sqrt(sum(a * a for a in v)) or 1e-300
    return [a / norm for a in v]


def cos(a, b):
    return sum(x * y for x, y in zip(a, b))


def oracle_era(x, xi, k):
    """ERA's rule as docs/methods/era.md states it, in plain Python."""
    n = len(x)
    total = sum(xi)
    p = [v / total for v in xi]
    ent = -sum(v * math.log(v) for v in p if v > 0)
    share = min(1.0, max(0.0, 1 - ent / math.log(n)))
    n_rel = min(k, max(0, math.ceil(k * share - 1e-9))) if max(xi) > min(xi) else 0
    order = sorted(range(n), key=lambda i: (-xi[i], i))
    kept = order[:n_rel]
    u = [unit(v) for v in x]
    while len(kept) < k:
        best, arg = -1.0, None
        for j in range(n):
            if j in kept:
                continue
            if kept:
                gap = min(1 - cos(u[i], u[j]) for i in kept)
            else:
                gap = min(1 - cos(u[i], u[j]) for i in range(n) if i != j)
            if gap > best + 1e-12:
                best, arg = gap, j
        kept.append(arg)
    return sorted(kept)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    g=st.integers(2, 4),
    frac=st.floats(0.1, 0.9),
    peaked=st.booleans(),
)
def test_era_keeps_what_its_rule_says(seed, g, frac, peaked):
    hidden, layout, prompt, n = small(seed, g)
    gen = torch.Generator().manual_seed(seed + 1)
    xi = torch.rand(n, generator=gen, dtype=torch.float64) + 0.01
    if peaked:  # a saliency concentrated on two tokens: relevance picks come first
        xi = xi * 0.01
        xi[: min(2, n)] = 1.0
    kept = max(1, min(n - 1, round(frac * n)))
    res = run_stage(ERA(), None, xi, hidden, layout, prompt, kept)
    got = image_kept(res, n)
    x = hidden[0, 2 : 2 + n].tolist()
    assert got == oracle_era(x, xi.tolist(), kept)


def test_era_share_is_zero_for_a_flat_saliency_and_large_for_a_peaked_one():
    valid = torch.ones(2, 8, dtype=torch.bool)
    xi = torch.stack([torch.ones(8), torch.tensor([1.0] + [1e-9] * 7)]).double()
    counts = ERA().relevant_counts(xi, valid, torch.tensor([4, 4]))
    assert counts.tolist() == [0, 4]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), g=st.integers(2, 4), frac=st.floats(0.1, 0.9))
def test_era_sizes_count_merged_tokens_by_relative_saliency(seed, g, frac):
    hidden, layout, prompt, n = small(seed, g)
    gen = torch.Generator().manual_seed(seed + 2)
    xi = torch.rand(n, generator=gen, dtype=torch.float64) + 0.01
    kept = max(1, min(n - 1, round(frac * n)))
    res = run_stage(ERA(), SaliencySizes(), xi, hidden, layout, prompt, kept)
    owner = res.provenance.owner[0, 2 : 2 + n]  # each image token's new index
    sizes = res.sizes[0]
    counts = Provenance(res.provenance.owner, res.provenance.current_len).sizes()[0]
    kept_new = res.kept_index[0]
    for j in range(sizes.shape[0]):
        if int(kept_new[j]) < 2 or int(kept_new[j]) >= 2 + n:  # text: stands for itself
            assert float(sizes[j]) == 1.0
            continue
        anchor = float(xi[int(kept_new[j]) - 2])
        want = sum(
            min(1.0, float(xi[i]) / anchor) if int(kept_new[j]) - 2 != i else 1.0
            for i in range(n)
            if int(owner[i]) == j
        )
        assert math.isclose(float(sizes[j]), want, rel_tol=1e-12)
        assert 1.0 <= float(sizes[j]) <= float(counts[j])


def test_era_sizes_equal_token_counts_when_saliency_is_flat():
    hidden, layout, prompt, n = small(3, 4)
    res = run_stage(ERA(), SaliencySizes(), torch.ones(n).double(), hidden, layout, prompt, 5)
    counts = Provenance(res.provenance.owner, res.provenance.current_len).sizes()
    assert torch.equal(res.sizes, counts.to(res.sizes.dtype))


def oracle_tops(x, xi, k, w=(1.0, 1.0, 1.0)):
    """TOPS's rule as docs/methods/tops.md states it, in plain Python."""
    n = len(x)
    u = [unit(v) for v in x]
    c = [[min(1.0, max(-1.0, cos(u[i], u[j]))) for j in range(n)] for i in range(n)]
    sim = [[0.5 * (v + 1) for v in row] for row in c]
    top = max(xi)
    q = [v / top for v in xi]
    cover, kept = [0.0] * n, []
    for _ in range(k):
        best, arg = -math.inf, None
        for j in range(n):
            if j in kept:
                continue
            gain = sum(max(0.0, sim[j][i] - cover[i]) for i in range(n)) / n
            near = min((0.5 * (1 - c[j][s]) for s in kept), default=1.0)
            score = w[0] * q[j] + w[1] * gain + w[2] * near
            if score > best + 1e-12:
                best, arg = score, j
        kept.append(arg)
        cover = [max(cover[i], sim[arg][i]) for i in range(n)]
    return sorted(kept)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    g=st.integers(2, 4),
    frac=st.floats(0.1, 0.9),
    w=st.tuples(*[st.sampled_from([0.0, 0.5, 1.0, 2.0])] * 3).filter(any),
)
def test_tops_keeps_what_its_rule_says(seed, g, frac, w):
    hidden, layout, prompt, n = small(seed, g)
    gen = torch.Generator().manual_seed(seed + 3)
    xi = torch.rand(n, generator=gen, dtype=torch.float64) + 0.01
    kept = max(1, min(n - 1, round(frac * n)))
    pruner = TOPS(relevance=w[0], coverage=w[1], diversity=w[2])
    res = run_stage(pruner, None, xi, hidden, layout, prompt, kept)
    got = image_kept(res, n)
    assert got == oracle_tops(hidden[0, 2 : 2 + n].tolist(), xi.tolist(), kept, w)


def test_tops_with_relevance_alone_is_a_relevance_top_k():
    hidden, layout, prompt, n = small(5, 4)
    xi = torch.arange(n, dtype=torch.float64).flip(0) + 1.0
    res = run_stage(TOPS(1.0, 0.0, 0.0), None, xi, hidden, layout, prompt, 5)
    assert image_kept(res, n) == [0, 1, 2, 3, 4]


def test_tops_refuses_all_zero_weights():
    with pytest.raises(ValueError, match="at least one"):
        TOPS(0.0, 0.0, 0.0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), a=st.integers(2, 9), k=st.integers(1, 9))
def test_facility_location_is_the_weighted_greedy(seed, a, k):
    k = min(k, a)
    gen = torch.Generator().manual_seed(seed)
    sim = torch.rand(1, a, a, generator=gen, dtype=torch.float64)
    w = torch.rand(1, a, generator=gen, dtype=torch.float64)
    got = facility_location(sim, w, torch.ones(1, a, dtype=torch.bool), torch.tensor([k]))
    s, ww = sim[0].tolist(), w[0].tolist()
    cover, kept = [0.0] * a, []
    for _ in range(k):
        gains = [
            -math.inf if j in kept else sum(ww[i] * max(0.0, s[j][i] - cover[i]) for i in range(a))
            for j in range(a)
        ]
        j = max(range(a), key=lambda i: (gains[i], -i))
        kept.append(j)
        cover = [max(cover[i], s[j][i]) for i in range(a)]
    assert sorted(torch.nonzero(got[0]).flatten().tolist()) == sorted(kept)


def test_eadp_checks_its_parameters():
    with pytest.raises(ValueError, match="alpha"):
        EADP(alpha=1.5)
    with pytest.raises(ValueError, match="text_keep"):
        EADP(text_keep=-0.1)


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_eadp_reads_a_long_question_in_chunks_with_the_same_weights(chunk, monkeypatch):
    """The dense relevance never holds [K, a, T] at once: the question is read in chunks, and
    the weights equal the one-chunk reading (float64, so no bit of the products differs)."""
    import lightkv.methods.eadp as eadp_module
    from lightkv.testing import contract

    inputs = contract.contract_batch(torch.float64, prompt=True)  # a 59-token text-only row
    stage = contract._stage(EADP(), inputs.spec)
    seen: list[torch.Tensor] = []
    real = EADP.weights

    def spy(self, prune_inputs, stage_inputs):
        seen.append(real(self, prune_inputs, stage_inputs))
        return seen[-1]

    monkeypatch.setattr(EADP, "weights", spy)
    whole = stage.run(inputs)
    monkeypatch.setattr(eadp_module, "QUESTION_CHUNK", chunk)
    parts = stage.run(inputs)
    assert len(seen) == 2 and torch.allclose(seen[0], seen[1], rtol=0, atol=1e-12)
    assert torch.equal(whole.layout.origin, parts.layout.origin)
