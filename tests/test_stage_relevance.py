"""`Stage.relevance` is the policy that computes ξ for its stage: adapters call it through
`Stage.relevance_scores`, which hands the policy only the context it reads (issue 25 item 3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightkv import ImageSegment, VisionLayout
from lightkv.pipeline import Stage
from lightkv.policies import QueryAxisSoftmax, Relevance, StageSpec


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
    xi = Stage(spec=spec, relevance=echo).relevance_scores(None, None, layout, prompt="ids", tower="att")
    assert echo.seen == {"prompt": "ids"} and torch.equal(xi, torch.ones(1, 20))  # no tower: it does not read it
    q, k = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    stage = Stage(spec=spec)
    assert torch.equal(stage.relevance_scores(q, k, layout, prompt="ids", tower="att"), QueryAxisSoftmax().score(q, k, layout))
    assert "relevance" not in stage.needs
