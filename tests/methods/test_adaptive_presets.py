"""The presets of TOPS Table 11 added here: SparseVLM (stages inside the LLM) and the two whose
count is their method's own (PruMerge+'s and TRIM's IQR outliers, under the
``pre_llm_adaptive`` schedule). They load, run a tiny LLaVA session, follow the kept-fraction
knob, refuse in one line what they cannot read, and keep their invariants on any input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv import ImageSegment, Stage, VisionLayout
from lightkv.methods.prumerge import PruMergePlus, iqr_count, keep_and_pool
from lightkv.methods.sparsevlm import SparseVLMSplit, recycled
from lightkv.methods.trim import trim_scores
from lightkv.policies import Prompt
from lightkv.testing import TINY_LLAVA

ADAPTIVE = ["prumerge-plus", "trim"]
FIELD = ["sparsevlm", *ADAPTIVE]
GEN = dict(max_new_tokens=3, do_sample=False)


@pytest.fixture(scope="module")
def llava():
    fam = TINY_MODELS["llava"]
    model = fam.build()
    return model, fam.collate(fam.examples(model))


def image_counts(session) -> list[int]:
    layout = session.last_prefill.final_layout
    return torch.bincount(layout.image[layout.vision_mask], minlength=layout.num_images).tolist()


@pytest.mark.parametrize("name", FIELD)
def test_the_preset_runs_a_tiny_llava_session(llava, name):
    model, batch = llava
    pipe = lightkv.load(name)
    assert getattr(pipe.stages(4)[0].spec, "adaptive", name == "sparsevlm")
    with torch.no_grad(), lightkv.apply(pipe, model) as session:
        out = model.generate(**batch, **GEN)
    assert out.shape[1] == batch["input_ids"].shape[1] + 3
    n = int((batch["input_ids"][0] == model.config.image_token_id).sum())
    counts = image_counts(session)
    assert all(1 <= c <= n for c in counts)


@pytest.mark.parametrize("name", ADAPTIVE)
@pytest.mark.parametrize("t", [0.55, 0.22, 0.11])
def test_the_knob_keeps_exactly_its_fraction(llava, name, t):
    """Under ``kept_fraction`` the count is no longer adaptive: each image of ``n`` tokens
    keeps ``n - floor((1 - t) n)``, the pooled token included."""
    model, batch = llava
    pipe = lightkv.load(name, kept_fraction=t)
    assert not pipe.stages(4)[0].spec.adaptive
    with torch.no_grad(), lightkv.apply(pipe, model) as session:
        model(**batch)
    n = int((batch["input_ids"][0] == model.config.image_token_id).sum())
    want = n - int(np.floor((1 - t) * n + 1e-9))
    assert image_counts(session) == [want] * len(image_counts(session))


@pytest.fixture(scope="module")
def llava32():
    """LLaVA-1.5's shape at tiny width: 32 decoder layers, 576 vision tokens."""
    model = TINY_LLAVA.build(
        num_layers=32, image_size=96, patch_size=4, hidden_size=32, intermediate_size=64
    )
    return model, TINY_LLAVA.collate([TINY_LLAVA.row(model, images=1, seed=0)])


@pytest.mark.parametrize("name", FIELD)
@pytest.mark.parametrize("t", [0.55, 0.22, 0.11])
def test_the_knob_reaches_its_target_on_llava_shape(llava32, name, t):
    """``lightkv.load(name, kept_fraction=t)`` on 32 layers and 576 tokens: the vision KV kept,
    averaged over the layers, within 0.01 of ``t`` (SparseVLM moves one common ratio of its
    three stages; the others fix their count)."""
    model, batch = llava32
    with torch.no_grad(), lightkv.apply(lightkv.load(name, kept_fraction=t), model) as session:
        model(**batch)
    report = session.report()
    assert report.missed_target is None
    assert report.kept_vision_fraction == pytest.approx(t, abs=0.01)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 600), st.data())
def test_sparsevlm_counts_its_clusters_in_the_budget(n, data):
    """``k_top`` plus the clusters of what it prunes is the stage's budget ``k``."""
    k = data.draw(st.integers(recycled(n)[1], n - 1)) if recycled(n)[1] < n else 1
    top = SparseVLMSplit.top_count(n, k)
    assert 0 <= top <= n - 1
    if recycled(n)[1] <= k:
        assert top + recycled(n - top)[1] == k


def test_sparsevlm_refuses_a_stage_without_prompt():
    layout = one_image(16)
    stage = lightkv.load("sparsevlm").stages(32)[0]
    q = torch.randn(1, 2, layout.seq_len, 4)
    with pytest.raises(ValueError, match="needs the prompt's token ids"):
        stage.relevance.score(q, q, layout, prompt=None, hidden=torch.randn(1, layout.seq_len, 8))


def test_prumerge_plus_refuses_a_model_without_tower_attention():
    model = TINY_MODELS["qwen2_5_vl"].build()
    with pytest.raises(NotImplementedError) as e:
        with lightkv.apply(lightkv.load("prumerge-plus"), model):
            pass
    assert "\n" not in str(e.value) and "tower" in str(e.value)


def one_image(n: int, before: int = 3, after: int = 4) -> VisionLayout:
    side = int(n**0.5)
    return VisionLayout.from_segments(
        1, before + n + after, [ImageSegment(row=0, offset=before, grid=(side, n // side))]
    )


def test_trim_refuses_a_prompt_without_a_question():
    layout = one_image(16, after=0)
    stage = lightkv.load("trim").stages(4)[0]
    hidden = torch.randn(1, layout.seq_len, 8)
    with pytest.raises(ValueError, match="question tokens after the image"):
        stage(hidden, layout, None, None, None, Prompt(torch.arange(layout.seq_len)[None]))
    layout = one_image(16)
    with pytest.raises(ValueError, match="needs the prompt"):
        stage(torch.randn(1, layout.seq_len, 8), layout, None, None, None, None)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1, width=32), min_size=1, max_size=80))
def test_iqr_count_is_numpys_outlier_count(values):
    """Oracle: ``numpy.percentile``'s quartiles, as both authors' codes compute them."""
    v = np.asarray(values, dtype=np.float32)
    q1, q3 = np.percentile(v, 25), np.percentile(v, 75)
    assert iqr_count(torch.tensor(v)) == int((v > q3 + 1.5 * (q3 - q1)).sum())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([16, 36, 64]), st.floats(0.2, 6))
def test_prumerge_plus_keeps_its_outliers_and_samples_inside_the_image(seed, n, scale):
    g = torch.Generator().manual_seed(seed)
    a = torch.softmax(scale * torch.randn(n, generator=g, dtype=torch.float64), 0).float()
    keep = PruMergePlus.adaptive_keep(a)
    c = iqr_count(a)
    if c == 0:
        assert bool(keep.all())
        return
    assert bool(keep[torch.topk(a, c).indices].all())  # every outlier
    stride = max(1, int(int(n / c) / 3))
    assert bool(keep[0 : n - 1 : stride].all())  # every sample
    assert int(keep.sum()) <= c + len(range(0, n - 1, stride))


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([16, 36]), st.integers(1, 15))
def test_trim_under_the_knob_keeps_the_top_scores_and_one_pooled_token(seed, n, k):
    """Fixed count: ``k - 1`` tokens of highest TRIM score stay as they are and one token holds
    the mean of the rest (oracle: the scores and the mean computed here)."""
    layout = one_image(n)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, layout.seq_len, 8, generator=g, dtype=torch.float64)
    st_ = lightkv.load("trim", kept_fraction=k / n).stages(4)[0]
    res = st_(hidden, layout, None, None, None, Prompt(torch.arange(layout.seq_len)[None]))
    img = slice(3, 3 + n)
    s = trim_scores(hidden[0, img], hidden[0, 3 + n :].mean(0))
    top = set((torch.topk(s, k - 1).indices + 3).tolist())
    kept = res.kept_index[0][res.layout.vision_mask[0]].tolist()
    assert len(kept) == k and top < set(kept)
    (host,) = set(kept) - top
    rest = [i for i in range(3, 3 + n) if i not in top]
    col = res.kept_index[0].tolist().index(host)
    torch.testing.assert_close(res.hidden[0, col], hidden[0, rest].mean(0))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=40))
def test_keep_and_pool_pools_exactly_what_is_not_kept(flags):
    n = len(flags)
    layout = VisionLayout.from_segments(1, n + 2, [ImageSegment(row=0, offset=1, grid=(1, n))])
    kept = torch.tensor(flags)
    part = keep_and_pool(layout, kept)
    inside = part.window[0, 1 : 1 + n] >= 0
    assert torch.equal(inside, ~kept)  # the graph is the image's tokens not kept
    assert bool((part.window[0, [0, n + 1]] == -1).all())  # text stays outside
    hosts = inside & ~part.is_src[0, 1 : 1 + n]
    assert int(hosts.sum()) == (0 if bool(kept.all()) else 1)
    if not bool(kept.all()):  # the host is the last token not kept
        assert int(torch.nonzero(hosts)[0]) == int(torch.nonzero(~kept)[-1])


def test_stage_is_reexported():  # the tests above build stages through lightkv.load
    assert isinstance(lightkv.load("trim").stages(4)[0], Stage)
