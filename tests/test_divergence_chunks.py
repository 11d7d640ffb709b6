"""Memory-bounded divergences (issue 25 item 4): a non-bilinear edge scorer runs in chunks of
windows and source rows within a memory budget, with exactly the one-call result; bilinear
scorers keep one call."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightkv
import lightkv.config
from lightkv import ImageSegment, VisionLayout
from lightkv.graph import BipartiteGraph
from lightkv.policies import EdgeScorer, StageSpec
from lightkv.policies.scorers import CosineDivergence
from lightkv.stage import Stage


@dataclass
class KeyJS(EdgeScorer):
    """Jensen-Shannon divergence between per-head softmaxes of the keys (not bilinear)."""

    features: str = "key_states"

    def divergence(self, src, dst):
        p = src.softmax(-1).unsqueeze(2)  # [K, a, 1, H, d]
        q = dst.softmax(-1).unsqueeze(1)  # [K, 1, b, H, d]
        m = (p + q) / 2
        kl = lambda x: (x * (x.clamp_min(1e-12).log() - m.clamp_min(1e-12).log())).sum(-1)  # noqa: E731
        return ((kl(p) + kl(q)) / 2).mean(-1)


@dataclass
class Recording(KeyJS):
    """KeyJS that records the pairs of every call."""

    def __post_init__(self):
        self.calls: list[tuple[int, int, int]] = []

    def divergence(self, src, dst):
        self.calls.append((src.shape[0], src.shape[1], dst.shape[1]))
        return super().divergence(src, dst)


def _graph(windows: int, size: int, seed: int) -> tuple[BipartiteGraph, int]:
    g = torch.Generator().manual_seed(seed)
    n = windows * size
    window = torch.randint(0, windows, (1, n), generator=g)
    window[0, :windows] = torch.arange(windows)  # compact ids
    is_src = torch.rand(1, n, generator=g) < 0.5
    return BipartiteGraph.build(window, is_src), n


@settings(max_examples=40, deadline=None)
@given(
    windows=st.integers(1, 5),
    size=st.integers(1, 12),
    heads=st.integers(1, 3),
    budget=st.integers(1, 4000),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_chunked_result_is_the_one_call_result(windows, size, heads, budget, dtype, seed):
    graph, n = _graph(windows, size, seed)
    feats = torch.randn(
        graph.num_nodes, heads, 4, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype
    )
    scorer = Recording()
    whole = scorer.best_edges(graph, feats, budget=2**40)
    assert len(scorer.calls) <= 1
    scorer.calls.clear()
    chunked = scorer.best_edges(graph, feats, budget=budget)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    assert whole[1].dtype == chunked[1].dtype
    # every call keeps within the budget, except a single source row against its window
    per_pair = scorer.pair_intermediates * feats[0].numel() * feats.element_size()
    for k, a, b in scorer.calls:
        assert k * a * b * per_pair <= budget or (k == 1 and a == 1)


def test_a_bilinear_scorer_is_one_call_whatever_the_budget():
    graph, _ = _graph(4, 10, 0)
    calls = []

    @dataclass
    class Spy(CosineDivergence):
        def divergence(self, src, dst):
            calls.append(src.shape)
            return super().divergence(src, dst)

    assert Spy.bilinear and not KeyJS.bilinear
    Spy().best_edges(graph, torch.randn(graph.num_nodes, 8), budget=1)
    assert len(calls) == 1


def test_the_stage_runs_a_js_scorer_within_its_pipeline_budget():
    layout = VisionLayout.from_segments(
        1, 4 + 24 * 24, [ImageSegment(row=0, offset=2, grid=(24, 24))]
    )
    n = layout.seq_len
    hidden = torch.randn(1, n, 16)
    keys = torch.randn(1, n, 4, 8)
    scorer = Recording()
    stage = Stage(
        spec=StageSpec(0, 0.5, windows_per_side=1), scorer=scorer, divergence_memory_mib=1
    )
    out = stage(hidden, layout, key_states=keys)
    budget = 2**20
    per_pair = scorer.pair_intermediates * 4 * 8 * 4
    assert len(scorer.calls) > 1 and all(k * a * b * per_pair <= budget for k, a, b in scorer.calls)
    scorer.calls.clear()
    again = Stage(spec=stage.spec, scorer=scorer, divergence_memory_mib=4096)(
        hidden, layout, key_states=keys
    )
    assert len(scorer.calls) == 1  # one call when it fits
    assert torch.equal(out.hidden, again.hidden) and torch.equal(out.kept_index, again.kept_index)


def test_the_budget_is_a_pipeline_option():
    pipe = lightkv.config.PipelineConfig.from_yaml_text("divergence_memory_mib: 32\n").build()
    assert {s.divergence_memory_mib for s in pipe.stages(32)} == {32}
    assert lightkv.load("lightkv").divergence_memory_mib == lightkv.stage.DIVERGENCE_MEMORY_MIB
    with pytest.raises(ValueError, match="divergence_memory_mib must be a positive integer"):
        Stage(spec=StageSpec(0, 0.5, windows_per_side=1), divergence_memory_mib=0)
