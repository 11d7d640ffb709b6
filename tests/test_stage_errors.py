"""Bad input to a stage is a clear ValueError/TypeError that names the problem."""

from __future__ import annotations

import pytest
import torch

import lightkv
from lightkv import ImageSegment, Stage, VisionLayout
from lightkv.graph import Provenance
from lightkv.policies import DropMessages, GlobalPartitioner, LowestRelevance, StageSpec


@pytest.fixture
def layout():
    return VisionLayout.from_segments(
        2, 12, [ImageSegment(0, 1, (3, 3)), ImageSegment(1, 2, (2, 4))]
    )


def stage(**kw):
    return Stage(
        StageSpec(0, 0.5, windows_per_side=kw.pop("wps", 2), window_size=kw.pop("ws", None)), **kw
    )


def test_mismatched_shapes(layout):
    with pytest.raises(ValueError, match=r"do not match the layout \[B=2, N=12\]"):
        stage()(torch.randn(2, 11, 4), layout)
    with pytest.raises(ValueError, match=r"must be \[B, N, D\]"):
        stage()(torch.randn(2, 12), layout)
    with pytest.raises(ValueError, match=r"relevance must be \[B, N\]"):
        stage()(torch.randn(2, 12, 4), layout, torch.rand(2, 11))
    with pytest.raises(ValueError, match="provenance does not describe"):
        stage()(torch.randn(2, 12, 4), layout, provenance=Provenance.identity(2, 10))
    with pytest.raises(TypeError, match="floating point"):
        stage()(torch.ones(2, 12, 4, dtype=torch.long), layout)
    with pytest.raises(TypeError, match="VisionLayout"):
        stage()(torch.randn(2, 12, 4), "layout")


def test_nan_features_and_bad_relevance(layout):
    x = torch.randn(2, 12, 4)
    x[0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        stage()(x, layout)
    with pytest.raises(ValueError, match="finite and non-negative"):
        stage()(torch.randn(2, 12, 4), layout, -torch.rand(2, 12))


def test_ratio_outside_range_and_window_larger_than_grid(layout):
    for bad in (1.0, 1.5, -0.01):
        with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\)"):
            Stage(StageSpec(0, bad, windows_per_side=1))
    with pytest.raises(ValueError, match="larger than an image grid"):
        stage(wps=None, ws=(3, 5))(torch.randn(2, 12, 4), layout)


def test_incoherent_compositions_are_refused():
    with pytest.raises(ValueError, match="needs an edge scorer"):
        Stage(StageSpec(0, 0.5, windows_per_side=1), scorer=None)
    with pytest.raises(ValueError, match="use passer 'drop'"):
        Stage(StageSpec(0, 0.5, windows_per_side=1), scorer=None, pruner=LowestRelevance())
    Stage(
        StageSpec(0, 0.5, windows_per_side=1),
        partitioner=GlobalPartitioner(split="all_src"),
        scorer=None,
        pruner=LowestRelevance(),
        passer=DropMessages(),
    )


def test_empty_layout_and_text_only_batches():
    with pytest.raises(ValueError, match="seq_len > 0"):
        VisionLayout.from_segments(1, 0, [])
    text_only = VisionLayout.from_segments(2, 5, [])
    x = torch.randn(2, 5, 3)
    for result in lightkv.load("lightkv").run(x, text_only, num_layers=32):
        assert torch.equal(result.hidden, x)


def test_low_precision_hidden_states_keep_their_dtype():
    lay = VisionLayout.from_segments(1, 40, [ImageSegment(0, 2, (6, 6))])
    x = torch.randn(1, 40, 16)
    ref = stage()(x, lay, torch.rand(1, 40))
    for dtype in (torch.bfloat16, torch.float16):
        out = stage()(x.to(dtype), lay, torch.rand(1, 40))
        assert out.hidden.dtype == dtype
        assert out.hidden.shape == ref.hidden.shape
