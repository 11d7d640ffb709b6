"""The parts of the low-budget presets: exact kept counts, VisionZip's dominant / contextual
split, downsampling to a count, checked against loop oracles written from the papers'
definitions (VisionZip's ``clip_encoder.py``; adaptive average pooling)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv import ImageSegment, VisionLayout
from lightkv.methods import DominantContextual, ResizePartitioner
from lightkv.methods.pooling import resized_grid
from lightkv.policies import AllSources, EdgeScorer, MessagePasser
from lightkv.policies.counts import kept_count
from lightkv.policies.schedulers import StageSpec
from lightkv.stage import Stage
from lightkv.testing import check_policy


def test_kept_count_is_exact_for_every_count_up_to_600():
    n = torch.arange(1, 601)
    for k in (1, 2, 28, 56, 64, 128, 192, 300):
        ok = n >= k
        ratios = [1.0 - k / int(m) for m in n[ok]]
        got = torch.stack([kept_count(m.view(1), r)[0] for m, r in zip(n[ok], ratios)])
        assert torch.equal(got, torch.full_like(got, k)), k
    # a plain floor misses often (35,135 of the (k, n) pairs up to 600), e.g. 4 of 5:
    assert 5 - math.floor((1 - 4 / 5) * 5) == 5
    assert kept_count(torch.tensor([5]), 1 - 4 / 5).item() == 4


def layout2():
    return VisionLayout.from_segments(
        2,
        44,
        [
            ImageSegment(row=0, offset=2, grid=(6, 6)),
            ImageSegment(row=1, offset=1, grid=(4, 8)),
            ImageSegment(row=1, offset=34, grid=(2, 4)),
        ],
    )


def visionzip_stage(ratio, contextual=10 / 64, authors=True):
    """VisionZip's stage: the authors' (a CLS slot, target plus mean) or lightkv's variant (all
    slots on patches, the mean of the target and the tokens merged into it)."""
    return Stage(
        StageSpec(0, ratio, windows_per_side=1, mode="pre_llm"),
        partitioner=DominantContextual(contextual, cls_slot=authors),
        scorer=EdgeScorer.create("cosine"),
        pruner=AllSources(),
        passer=MessagePasser.create("target_plus_mean" if authors else "size_mean"),
    )


def visionzip_oracle(
    x: torch.Tensor, xi: torch.Tensor, k: int, contextual: float, authors: bool = True
) -> torch.Tensor:
    """One image's kept tokens as VisionZip computes them, one token at a time: ``x [n, D]``
    in raster order, ``xi [n]`` -> ``[k, D]`` (``[k - 1, D]`` with the authors' CLS slot) in
    the order of the kept tokens' positions."""
    n = x.shape[0]
    if k >= n:
        return x
    c = max(1, round(k * contextual))
    d = max(0, k - c - (1 if authors else 0))  # the authors spend a dominant slot on the CLS
    ranked = sorted(range(n), key=lambda i: (-float(xi[i]), i))
    dominant = set(ranked[:d])
    rest = [i for i in range(n) if i not in dominant]
    step = max(1, len(rest) // c)
    targets = rest[0 : len(rest) : step][:c]
    members = {t: [t] for t in targets}
    for i in rest:
        if i in members:
            continue
        sims = [float(F.cosine_similarity(x[i].double(), x[t].double(), dim=0)) for t in targets]
        members[targets[max(range(len(targets)), key=lambda j: (sims[j], -j))]].append(i)
    out = {i: x[i] for i in dominant}
    for t, ms in members.items():
        if authors:  # contextual_tokens = target_hidden + aggregated_hidden
            rest_mean = torch.stack([x[m] for m in ms[1:]]).double().mean(0) if ms[1:] else 0
            out[t] = (x[t].double() + rest_mean).to(x.dtype)
        else:
            out[t] = torch.stack([x[m] for m in ms]).double().mean(0).to(x.dtype)
    return torch.stack([out[i] for i in sorted(out)])


def c_d(k: int, n: int) -> tuple[int, int]:
    """VisionZip's contextual and dominant slots of a budget ``k < n`` (0, 0 at ``k = n``)."""
    c = max(1, round(k * 10 / 64)) if k < n else 0
    return c, k - c


@pytest.mark.parametrize("authors", [True, False])
@pytest.mark.parametrize("k_share", [1 / 9, 2 / 9, 0.55])
def test_visionzip_stage_equals_the_loop_oracle(k_share, authors):
    layout = layout2()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 44, 8, generator=g)
    xi = torch.rand(2, 44, generator=g)
    ratio = 1 - k_share
    res = visionzip_stage(ratio, authors=authors)(x, layout, xi)
    for img, (row, off, (h, w)) in enumerate([(0, 2, (6, 6)), (1, 1, (4, 8)), (1, 34, (2, 4))]):
        n = h * w
        k = int(kept_count(torch.tensor([n]), ratio))
        want = visionzip_oracle(x[row, off : off + n], xi[row, off : off + n], k, 10 / 64, authors)
        mine = res.layout.image[row] == img
        assert int(mine.sum()) == want.shape[0] == k - (authors and k < n and c_d(k, n)[1] > 0)
        torch.testing.assert_close(res.hidden[row][mine], want, rtol=1e-5, atol=1e-6)


def test_visionzip_keeps_the_most_attended_tokens_whole():
    layout = VisionLayout.from_segments(1, 65, [ImageSegment(row=0, offset=1, grid=(8, 8))])
    x = torch.randn(1, 65, 4)
    xi = torch.zeros(1, 65)
    xi[0, [5, 17, 40]] = 1.0
    res = visionzip_stage(1 - 8 / 64, contextual=0.5)(
        x, layout, xi
    )  # k = 8: 4 dominant, 4 contextual
    kept = res.layout.origin[0][res.layout.vision_mask[0]].tolist()
    vision_hidden = res.hidden[0][res.layout.vision_mask[0]]
    for pos in (5, 17, 40):
        assert torch.equal(vision_hidden[kept.index(pos)], x[0, pos])  # kept whole, not merged
    assert res.provenance.sizes()[0][res.layout.vision_mask[0]].sum() == 64


def test_visionzip_needs_relevance():
    layout = layout2()
    with pytest.raises(ValueError, match="ranks tokens by relevance"):
        visionzip_stage(0.5)(torch.randn(2, 44, 4), layout)


def resize_stage(ratio):
    return Stage(
        StageSpec(0, ratio, windows_per_side=1, mode="pre_llm"),
        partitioner=ResizePartitioner(),
        scorer=EdgeScorer.create("cosine"),
        pruner=AllSources(),
        passer=MessagePasser.create("size_mean"),
    )


@pytest.mark.parametrize(
    "grid,k,out",
    [((6, 6), 4, (2, 2)), ((6, 6), 9, (3, 3)), ((4, 8), 8, (2, 4)), ((24, 24), 64, (8, 8))],
)
def test_resize_equals_adaptive_average_pooling_on_divisible_grids(grid, k, out):
    h, w = grid
    layout = VisionLayout.from_segments(1, h * w + 3, [ImageSegment(row=0, offset=1, grid=grid)])
    x = torch.randn(1, h * w + 3, 5, dtype=torch.float64)
    res = resize_stage(1 - k / (h * w))(x, layout)
    ref = F.adaptive_avg_pool2d(x[0, 1 : 1 + h * w].T.reshape(1, 5, h, w), out).reshape(5, -1).T
    torch.testing.assert_close(res.hidden[0][res.layout.vision_mask[0]], ref)
    torch.testing.assert_close(
        res.hidden[0][~res.layout.vision_mask[0]], x[0, [0, h * w + 1, h * w + 2]]
    )


@settings(max_examples=40, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), share=st.floats(0.05, 0.95))
def test_resize_blocks_are_means_of_disjoint_blocks_within_budget(h, w, share):
    n = h * w
    layout = VisionLayout.from_segments(1, n, [ImageSegment(row=0, offset=0, grid=(h, w))])
    x = torch.randn(1, n, 3, dtype=torch.float64)
    ratio = min(share, 0.999)
    res = resize_stage(ratio)(x, layout)
    k = int(kept_count(torch.tensor([n]), ratio))
    hh, ww = (int(v) for v in resized_grid(torch.tensor([h]), torch.tensor([w]), torch.tensor([k])))
    kept = int(res.layout.vision_mask.sum())
    if k == n:
        assert kept == n
        return
    assert kept == hh * ww <= max(k, hh)
    # oracle: token (r, c) belongs to block (floor(r hh / h), floor(c ww / w)); each block's mean
    blocks = {}
    for r in range(h):
        for c in range(w):
            blocks.setdefault((r * hh // h, c * ww // w), []).append(r * w + c)
    want = torch.stack([x[0, idx].mean(0) for _, idx in sorted(blocks.items())])
    torch.testing.assert_close(res.hidden[0], want)


@pytest.mark.parametrize("stage", [visionzip_stage, resize_stage])
def test_rows_alone_equal_rows_in_the_batch(stage):
    layout = layout2()
    x = torch.randn(2, 44, 6)
    xi = torch.rand(2, 44)
    together = stage(0.7)(x, layout, xi)
    for r in range(2):
        alone = stage(0.7)(x[r : r + 1], layout.row(r), xi[r : r + 1])
        va, vt = alone.layout.valid_mask[0], together.layout.valid_mask[r]
        torch.testing.assert_close(alone.hidden[0][va], together.hidden[r][vt])


def test_policy_contract():
    check_policy(DominantContextual)
    check_policy(DominantContextual, contextual=1.0)
    check_policy(ResizePartitioner)
    check_policy(AllSources)
    with pytest.raises(ValueError, match="contextual"):
        DominantContextual(contextual=0.0)
