"""`lightkv_lab.bench.agreement` (the instrument against TOPS's Table 11) and
`lightkv_lab.bench.oracle` (the must-lose and must-win methods): rank correlation against an
independent formula, budgets as the table counts them, the oracle's ranking, and one small
end-to-end run on the bundled Scenes model."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkv_lab.bench import agreement as ag
from lightkv_lab.bench.oracle import RegionOracle, random_pipeline

from lightkv import ImageSegment, VisionLayout

distinct = st.lists(st.integers(-1000, 1000), min_size=3, max_size=12, unique=True).map(
    lambda v: [float(x) for x in v]
)


@given(distinct, st.randoms(use_true_random=False))
def test_spearman_without_ties_is_the_textbook_formula(x, rnd):
    y = list(x)
    rnd.shuffle(y)
    n = len(x)
    rank = lambda v: {val: i for i, val in enumerate(sorted(v))}  # noqa: E731
    rx, ry = rank(x), rank(y)
    d2 = sum((rx[a] - ry[b]) ** 2 for a, b in zip(x, y, strict=True))
    assert ag.spearman(x, y) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)), abs=1e-12)


@given(distinct)
def test_spearman_reads_only_the_order(x):
    assert ag.spearman(x, [math.exp(v / 1000) for v in x]) == pytest.approx(1.0)
    assert ag.spearman(x, [-v for v in x]) == pytest.approx(-1.0)


def test_spearman_ties_share_ranks_and_constants_are_refused():
    # ranks (1.5, 1.5, 3) against (1, 2, 3): the Pearson correlation of the ranks
    assert ag.spearman([1.0, 1.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(math.sqrt(3) / 2)
    with pytest.raises(ValueError, match="constant"):
        ag.spearman([1.0, 1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="one length"):
        ag.spearman([1.0, 2.0], [1.0])


def test_mean_absolute_difference():
    assert ag.mean_absolute_difference([90.0, 80.0], [93.0, 70.0]) == 6.5


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 30), min_size=2, max_size=4, unique=True).map(sorted),
    st.floats(0.05, 0.6),
)
def test_a_common_ratio_keeps_the_share_on_average_after_the_first_stage(layers, share):
    num_layers = 32
    r = ag._common_ratio(tuple(layers), num_layers, share)
    after = range(layers[0] + 1, num_layers)
    kept = [(1 - r) ** sum(s < layer for s in layers) for layer in after]
    assert sum(kept) / len(kept) == pytest.approx(share, abs=1e-9)


def test_retained_budgets_as_the_table_counts_them():
    fastv, how = ag.retained_pipeline("fastv", 6, 0.1111)
    assert how == "retained" and fastv.scheduler.removal_ratios == pytest.approx((0.8889,))
    pdrop, _ = ag.retained_pipeline("pdrop", 6, 0.1111)
    layers, (r,) = pdrop.scheduler.layers, pdrop.scheduler.removal_ratios
    kept = [(1 - r) ** sum(s < lay for s in layers) for lay in range(layers[0] + 1, 6)]
    assert sum(kept) / len(kept) == pytest.approx(0.1111)
    divprune, how = ag.retained_pipeline("divprune", 6, 0.1111)
    assert how == "before the LLM" and divprune.scheduler.removal_ratio == pytest.approx(0.8889)
    assert random_pipeline(6, 0.1111).scheduler == divprune.scheduler


def test_the_oracle_ranks_the_region_first_then_by_the_tower():
    layout = VisionLayout.from_segments(
        2, 7, [ImageSegment(row=b, offset=1 + b, grid=(2, 2)) for b in range(2)]
    )
    gen = torch.Generator().manual_seed(0)
    tower = torch.rand(2, 3, 7, generator=gen)
    oracle = RegionOracle(regions=torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.bool))
    xi = oracle.score(None, None, layout, tower=tower)
    plain = RegionOracle.__mro__[1].score(oracle, None, None, layout, tower=tower)
    for b, region_pos in ((0, [2, 4]), (1, [2])):
        vis = layout.vision_mask[b].nonzero()[:, 0].tolist()
        others = [p for p in vis if p not in region_pos]
        assert min(xi[b, region_pos]) > max(xi[b, others])
        assert torch.equal(xi[b, others], plain[b, others])  # the fill follows the tower
    assert torch.equal(xi[~layout.vision_mask], torch.zeros_like(xi[~layout.vision_mask]))
    with pytest.raises(ValueError, match="regions for 1 rows"):
        RegionOracle(regions=torch.zeros(1, 4, dtype=torch.bool)).score(
            None, None, layout, tower=tower
        )


def test_an_agreement_run_on_scenes_end_to_end():
    result = ag.run(
        "scenes", episodes=8, seed=7, methods=("divprune", "fastv"), shares=(0.2222,), batch=4,
        bootstrap=50, progress=False,
    )  # fmt: skip
    base = result["uncompressed"]["accuracy"]["overall"]
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"divprune", "fastv", "random (before the LLM)",
                         "oracle (asked region first)"}  # fmt: skip
    for r in rows.values():
        assert r["retained"] == pytest.approx(100 * r["accuracy"]["overall"] / base)
        lo, hi = r["retained_interval"]
        assert lo <= r["retained"] <= hi
    assert rows["divprune"]["field"] == 96.7 and rows["fastv"]["field"] == 91.6
    assert result["tuned_on"] == ["fastv", "pdrop"]
    assert result["summary"]["agreement"]["points"] == 2
    with pytest.raises(ValueError, match="unknown preset"):
        ag.run("scenes", 2, 0, ("no-such",), (0.2222,), progress=False)


def test_a_rerun_replaces_its_rows_in_place_and_the_summary_follows():
    kw = dict(episodes=8, seed=7, shares=(0.2222,), batch=4, bootstrap=50, progress=False)
    old = ag.run("scenes", methods=("divprune", "fastv"), **kw)
    new = ag.run("scenes", methods=("fastv",), **kw)
    for r in new["rows"]:
        r["retained"] += 1.0 if r["method"] == "fastv" else 0.0  # a fixed method's new score
    joined = ag.replace_rows(old, new)
    assert [(r["method"], r["share"]) for r in joined["rows"]] == [
        (r["method"], r["share"]) for r in old["rows"]
    ]
    got = {r["method"]: r["retained"] for r in joined["rows"]}
    was = {r["method"]: r["retained"] for r in old["rows"]}
    assert got["fastv"] == was["fastv"] + 1.0 and got["divprune"] == was["divprune"]
    assert joined["summary"] == ag.summarise(joined["rows"])
    other = ag.run("scenes", methods=("fastv",), **{**kw, "seed": 8})
    with pytest.raises(ValueError, match="seed"):
        ag.replace_rows(old, other)
