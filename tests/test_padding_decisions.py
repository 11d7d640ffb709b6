"""Where padding enters (issue 40 item 12, a finding, not a fix): given the same hidden
states and relevance, lightkv's own decisions (windows, divergences, ranks, ties, merges)
are the same for a row alone and left-padded inside a batch, for every merging preset; so
the batch dependence measured on models (first-token log-probabilities moving by more than
1e-3 on a few rows under left padding) enters through the model's padded kernels, whose
hidden states differ in the last bits and flip near-ties, not through lightkv's
arithmetic. The relevance lightkv computes from given queries and keys is padding-free too."""

from __future__ import annotations

import pytest
import torch

import lightkv
from lightkv import ImageSegment, VisionLayout
from lightkv.policies import QueryAxisSoftmax

N, PAD, D = 5 + 576 + 9, 7, 32


def _pair(dtype):
    g = torch.Generator().manual_seed(0)
    alone = VisionLayout.from_segments(1, N, [ImageSegment(0, 5, (24, 24))])
    pad = torch.zeros(2, N + PAD, dtype=torch.bool)
    pad[0, :PAD] = True
    both = VisionLayout.from_segments(
        2,
        N + PAD,
        [ImageSegment(0, 5 + PAD, (24, 24)), ImageSegment(1, 5, (24, 24))],
        padding_mask=pad,
    )
    h = torch.randn(1, N, D, generator=g, dtype=dtype)
    hb = torch.randn(2, N + PAD, D, generator=g, dtype=dtype)
    hb[0, PAD:] = h[0]
    return alone, both, h, hb, g


@pytest.mark.parametrize(
    "preset", ["lightkv", "lightkv-paper", "lightkv-paper-released", "tome", "pool"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_row_merges_alike_alone_and_left_padded(preset, dtype):
    alone, both, h, hb, g = _pair(dtype)
    xi = torch.rand(1, N, generator=g, dtype=dtype) * alone.vision_mask
    xb = torch.rand(2, N + PAD, generator=g, dtype=dtype) * both.vision_mask
    xb[0, PAD:] = xi[0]
    stage = lightkv.load(preset).stages(num_layers=32)[0]
    a, b = stage(h, alone, xi), stage(hb, both, xb)
    ka, kb = a.kept_index[0], b.kept_index[0]
    ka, kb = ka[ka >= 0], kb[kb >= PAD] - PAD
    assert torch.equal(ka, kb)
    torch.testing.assert_close(
        b.hidden[0, PAD : PAD + len(kb)], a.hidden[0, : len(ka)], rtol=0, atol=0
    )


def test_query_softmax_relevance_is_padding_free():
    alone, both, _, _, g = _pair(torch.float64)
    q = torch.randn(1, 4, N, 16, generator=g, dtype=torch.float64)
    k = torch.randn(1, 4, N, 16, generator=g, dtype=torch.float64)
    qb = torch.randn(2, 4, N + PAD, 16, generator=g, dtype=torch.float64)
    kb = torch.randn(2, 4, N + PAD, 16, generator=g, dtype=torch.float64)
    qb[0, :, PAD:], kb[0, :, PAD:] = q[0], k[0]
    xi, xb = QueryAxisSoftmax().score(q, k, alone), QueryAxisSoftmax().score(qb, kb, both)
    torch.testing.assert_close(xb[0, PAD:], xi[0], rtol=1e-12, atol=1e-14)
