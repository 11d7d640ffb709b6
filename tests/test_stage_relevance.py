"""`Stage.relevance` is the policy that computes ξ for its stage: adapters call it through
`Stage.relevance_scores`, which hands the policy only the context it reads (issue 25 item 3)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lightkv import ImageSegment, VisionLayout
from lightkv.policies import QueryAxisSoftmax, Relevance, StageSpec
from lightkv.stage import Stage
from tests.strategies import batches


@dataclass
class Echo(Relevance):
    """ξ = 1 everywhere; records what it was given."""

    query_rows = "none"
    key_cols = "none"
    reads_prompt = True

    def __post_init__(self):
        self.seen: dict = {}

    def score(self, queries, keys, layout, **context):
        self.seen = context
        return torch.ones(layout.batch_size, layout.seq_len)


def test_relevance_scores_is_the_stage_policy_with_only_what_it_reads():
    layout = VisionLayout.from_segments(1, 20, [ImageSegment(row=0, offset=2, grid=(4, 4))])
    spec = StageSpec(0, 0.5, windows_per_side=1)
    echo = Echo()
    xi = Stage(spec=spec, relevance=echo).relevance_scores(
        None, None, layout, prompt="ids", tower="att"
    )
    assert echo.seen == {"prompt": "ids"} and torch.equal(
        xi, torch.ones(1, 20)
    )  # no tower: it does not read it
    q, k = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    stage = Stage(spec=spec)
    assert torch.equal(
        stage.relevance_scores(q, k, layout, prompt="ids", tower="att"),
        QueryAxisSoftmax().score(q, k, layout),
    )
    assert "relevance" not in stage.needs


@settings(max_examples=40, deadline=None)
@given(case=batches(), heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]))
def test_query_softmax_reads_packed_text_keys_as_the_full_ones(case, heads):
    """`packed_text_keys`: the text columns' keys packed by `pack_rows` give the same ξ, bit
    for bit, as full-length keys (what adapters passed before, zeros outside the text),
    over padding, batches, images without text between them and grouped-query heads."""
    from lightkv.graph.scatter import pack_rows

    layout = case.layout
    b, n = layout.batch_size, layout.seq_len
    h, h_kv = heads
    gen = torch.Generator().manual_seed(int(case.hidden.abs().sum() * 1000) % 2**31)
    q = torch.randn(b, h, n, 8, generator=gen)
    k = torch.randn(b, h_kv, n, 8, generator=gen)
    text_pos, _ = pack_rows(layout.text_mask)
    packed = k.gather(2, text_pos[:, None, :, None].expand(-1, h_kv, -1, 8))
    assume(text_pos.shape[1] < n)  # a row of text only: adapters pass full keys then
    rel = QueryAxisSoftmax()
    assert torch.equal(rel.score(q, packed, layout), rel.score(q, k, layout))
    with pytest.raises(ValueError, match="do not match the layout"):
        rel.score(q, torch.cat([k, k[:, :, :1]], dim=2), layout)  # N + 1 columns: neither form
