"""Relevance computed a block at a time (`lightkv.policies.softmax_sums`): equal to naive
per-column and per-row oracles written here (float64 to 1e-12, float32 to rounding), for any
block size, and never holding the ``H x N x T`` scores at once."""

from __future__ import annotations

import math
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from lightkv import ImageSegment, VisionLayout
from lightkv.policies import QueryAxisSoftmax, softmax_sums
from lightkv.policies.hashing import seeded_uniform_pairs, token_identity
from lightkv.policies.prompt import Prompt
from lightkv.policies.question import QuestionAttention
from lightkv.policies.relevance import RandomRelevance, TextQueryAttention
from tests.strategies import batches

blocks = st.sampled_from([1, 2, 3, 7, 16, 50, 333, 1 << 22])


def _qk(layout, heads, kv_heads, dtype, seed, d=5):
    gen = torch.Generator().manual_seed(seed)
    b, n = layout.batch_size, layout.seq_len
    q = torch.randn(b, heads, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, kv_heads, n, d, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype)


def _reduce(per_head, heads):
    return {"sum": per_head.sum(0), "mean": per_head.mean(0), "max": per_head.amax(0)}[heads]


def _query_softmax_oracle(q, k, layout, heads):
    """Column by column: softmax over the valid query rows of ``q_i . k_t / sqrt(d)``, for
    every text column ``t``, added up on the vision rows; python loops, float64."""
    q, k = q.double(), k.double()
    b, h, n, d = q.shape
    rep = h // k.shape[1]
    out = torch.zeros(b, n, dtype=torch.float64)
    for r in range(b):
        rows = layout.valid_mask[r].nonzero().flatten().tolist()
        per_head = torch.zeros(h, n, dtype=torch.float64)
        for hh in range(h):
            for t in layout.text_mask[r].nonzero().flatten().tolist():
                col = torch.stack([q[r, hh, i] @ k[r, hh // rep, t] for i in rows]) / math.sqrt(d)
                weights = torch.exp(col - torch.logsumexp(col, 0))
                for i, w in zip(rows, weights):
                    per_head[hh, i] += w
        out[r] = _reduce(per_head, heads)
    return torch.where(layout.vision_mask, out, torch.zeros_like(out))


def _row_attention_oracle(q, k, layout, read, heads, causal):
    """Row by row: each read query row's softmax over the keys it may see (valid, at or
    before its original position when causal), added up; python loops, float64."""
    q, k = q.double(), k.double()
    b, h, n, d = q.shape
    rep = h // k.shape[1]
    origin = layout.origin
    out = torch.zeros(b, n, dtype=torch.float64)
    for r in range(b):
        per_head = torch.zeros(h, n, dtype=torch.float64)
        for i in read[r].nonzero().flatten().tolist():
            cols = [
                j
                for j in range(n)
                if layout.valid_mask[r, j] and (not causal or origin[r, j] <= origin[r, i])
            ]
            if not cols:
                continue
            for hh in range(h):
                row = torch.stack([q[r, hh, i] @ k[r, hh // rep, j] for j in cols]) / math.sqrt(d)
                per_head[hh, cols] += torch.exp(row - torch.logsumexp(row, 0))
        out[r] = _reduce(per_head, heads)
    return torch.where(layout.vision_mask, out, torch.zeros_like(out))


def _float32_close(got, want):
    """Float32 results against the float64 oracle: equal to float32 rounding."""
    assert got.dtype == torch.float32
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, rtol=3e-5, atol=3e-6 * max(scale, 1.0))


heads_and_kv = st.sampled_from([(1, 1), (2, 1), (3, 3), (4, 2)])
reductions = st.sampled_from(["sum", "mean", "max"])


@settings(max_examples=40, deadline=None)
@given(
    case=batches(max_side=5),
    hk=heads_and_kv,
    how=reductions,
    block=blocks,
    fused=st.booleans(),
    seed=st.integers(0, 99),
)
def test_query_softmax_equals_the_per_column_oracle(case, hk, how, block, fused, seed):
    layout = case.layout
    q, k = _qk(layout, *hk, torch.float64, seed)
    want = _query_softmax_oracle(q, k, layout, how)
    with (
        mock.patch.object(softmax_sums, "BLOCK", block),
        mock.patch.object(softmax_sums, "FUSED", fused),
    ):
        got = QueryAxisSoftmax(heads=how).score(q, k, layout)
        got32 = QueryAxisSoftmax(heads=how).score(q.float(), k.float(), layout)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    _float32_close(got32, want)


@settings(max_examples=25, deadline=None)
@given(
    case=batches(max_side=5),
    hk=heads_and_kv,
    block=blocks,
    fused=st.booleans(),
    seed=st.integers(0, 99),
)
def test_query_softmax_reads_packed_text_keys_as_it_reads_full_ones(case, hk, block, fused, seed):
    from lightkv.graph.scatter import pack_rows

    layout = case.layout
    q, k = _qk(layout, *hk, torch.float64, seed)
    pos, _ = pack_rows(layout.text_mask)
    packed = k.gather(2, pos[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1]))
    with (
        mock.patch.object(softmax_sums, "BLOCK", block),
        mock.patch.object(softmax_sums, "FUSED", fused),
    ):
        full = QueryAxisSoftmax().score(q, k, layout)
        if pos.shape[1] < layout.seq_len:
            assert torch.equal(QueryAxisSoftmax().score(q, packed, layout), full)
    torch.testing.assert_close(full, _query_softmax_oracle(q, k, layout, "sum"), rtol=1e-12, atol=0)


@settings(max_examples=30, deadline=None)
@given(
    case=batches(max_side=5),
    hk=heads_and_kv,
    how=reductions,
    causal=st.booleans(),
    block=blocks,
    seed=st.integers(0, 99),
)
def test_text_attention_equals_the_per_row_oracle(case, hk, how, causal, block, seed):
    layout = case.layout
    q, k = _qk(layout, *hk, torch.float64, seed)
    want = _row_attention_oracle(q, k, layout, layout.text_mask, how, causal)
    policy = TextQueryAttention(heads=how, causal=causal)
    with mock.patch.object(softmax_sums, "BLOCK", block):
        got = policy.score(q, k, layout)
        got32 = policy.score(q.float(), k.float(), layout)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    _float32_close(got32, want)


@settings(max_examples=20, deadline=None)
@given(case=batches(max_side=4), block=blocks, seed=st.integers(0, 99))
def test_question_attention_equals_the_per_row_oracle(case, block, seed):
    layout = case.layout
    q, k = _qk(layout, 4, 2, torch.float64, seed)
    ids = torch.randint(3, 90, (layout.batch_size, layout.seq_len), generator=torch.Generator())
    prompt = Prompt(ids)
    question = prompt.question_mask(layout)
    want = _row_attention_oracle(q, k, layout, question, "mean", True)
    with mock.patch.object(softmax_sums, "BLOCK", block):
        got = QuestionAttention().score(q, k, layout, prompt=prompt)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(case=batches(max_side=4), heads=st.integers(1, 4), block=blocks, seed=st.integers(0, 9))
def test_random_relevance_equals_the_softmax_of_its_whole_draw(case, heads, block, seed):
    layout = case.layout
    identity = token_identity(layout)
    identity = torch.where(layout.image >= 0, identity, layout.valid_mask.long().cumsum(1) - 1)
    want = torch.zeros(layout.batch_size, layout.seq_len, dtype=torch.float64)
    for r in range(layout.batch_size):
        text = layout.text_mask[r].nonzero().flatten()
        rows = layout.valid_mask[r].nonzero().flatten()
        if not len(text):
            continue
        draw = seeded_uniform_pairs(identity[r : r + 1], identity[r : r + 1, text], heads, seed)[0]
        for hh in range(heads):
            for t in range(len(text)):
                col = draw[hh, rows, t]
                want[r, rows] += torch.exp(col - torch.logsumexp(col, 0))
    want = torch.where(layout.vision_mask, want, torch.zeros_like(want))
    q = torch.zeros(layout.batch_size, heads, layout.seq_len, 2)
    with mock.patch.object(softmax_sums, "BLOCK", block * 8):  # it takes an eighth of a block
        got = RandomRelevance(seed=seed).score(q, None, layout)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@given(heads=st.integers(1, 6), split=st.integers(0, 6), seed=st.integers(0, 9))
def test_seeded_pairs_of_a_block_of_heads_are_those_heads_of_the_whole_draw(heads, split, seed):
    rows, cols = torch.arange(7).unsqueeze(0), torch.arange(3, 8).unsqueeze(0)
    whole = seeded_uniform_pairs(rows, cols, heads, seed)
    split = min(split, heads)
    part = seeded_uniform_pairs(rows, cols, heads - split, seed, first_head=split)
    assert torch.equal(part, whole[:, split:])


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an operator returns inside the block."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_long_prompts_never_hold_the_scores_at_once():
    # 1,000 text tokens around a 20 x 20 image: the H x N x T scores are 5.6M floats
    n, heads, d = 1420, 4, 8
    layout = VisionLayout.from_segments(1, n, [ImageSegment(0, 500, (20, 20))])
    q, k = _qk(layout, heads, heads, torch.float32, 0, d=d)
    text = int(layout.text_mask.sum())
    block = 1 << 14
    policies = (QueryAxisSoftmax(), QueryAxisSoftmax(), TextQueryAttention(), RandomRelevance())
    for fused, policy in zip((True, False, False, False), policies):
        with (
            mock.patch.object(softmax_sums, "BLOCK", block),
            mock.patch.object(softmax_sums, "FUSED", fused),
            _Largest() as largest,
        ):
            policy.score(q, k, layout)
        per_block = block * torch.get_num_threads()
        assert largest.most <= max(per_block, heads * n * d), type(policy).__name__
        assert largest.most < heads * n * text // 8


def test_the_fused_cpu_kernel_is_found_on_the_torch_the_project_installs():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 3):
        assert softmax_sums._fused_kernel() is not None
