"""Each preset that carries a paper's name keeps exactly the tokens its authors' released code
keeps, on inputs recorded from that code (``fixtures/<method>.json``: the repository, the
commit, how the authors' function was called, the seeds and the kept indices; the tensors are
regenerated here from the seeds, `tests.methods.recipes`). The authors' code ran unchanged in
a scratch script outside this repository; none of it is here, only what it returned.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import replace

import pytest
import torch

import lightkv
from lightkv.presets import PRESETS
from tests.methods import recipes as R

METHODS = ["cdpruner", "dart", "divprune", "eadp", "fastv", "holov", "mmtok", "prumerge-plus",
           "scope", "sparsevlm", "trim", "visionzip", "vispruner", "vscan"]  # fmt: skip


def cases(method: str):
    return [
        pytest.param(c, id=f"seed{c['seed']}-n{c['n']}-kept{c['kept']}-s{c.get('scale', 1)}")
        for c in R.fixture(method)["cases"]
    ]


def stage(preset: str, n: int, kept: int, index: int = 0):
    """Stage ``index`` of ``preset`` (32 layers), its removal ratio keeping ``kept`` of ``n``."""
    st = lightkv.load(preset).stages(32)[index]
    return dataclasses.replace(st, spec=dataclasses.replace(st.spec, removal_ratio=1 - kept / n))


def inputs(method: str, case: dict) -> dict[str, torch.Tensor]:
    return R.draw(case["seed"], case["n"], R.fixture(method)["draws"])


def tower(st, rows: torch.Tensor, n: int) -> torch.Tensor:
    """The preset's tower relevance of a CLS row's patch columns ``rows [H, n]``."""
    return st.relevance_scores(None, None, R.layout(n), tower=R.on_image(rows, n))


def test_every_recorded_method_is_tested_here():
    assert sorted(p.stem for p in R.FIXTURES.glob("*.json")) == METHODS


@pytest.mark.parametrize("method", METHODS)
def test_every_fixture_cites_the_authors_repository_and_commit(method):
    fx = R.fixture(method)
    assert fx["repository"].startswith("https://github.com/")
    assert re.fullmatch(r"[0-9a-f]{40}", fx["commit"])
    assert fx["preset"] == method and method in PRESETS
    assert fx["code"] and fx["call"] and fx["draws"]
    cases = fx["cases"]
    assert len(cases) >= 12 and {c["n"] for c in cases} >= {576}
    assert len({c["seed"] for c in cases}) >= 3 and len({c["kept"] for c in cases}) >= 3
    for c in cases:  # sorted, distinct image indices (none: TRIM pooled the whole image)
        assert c["indices"] == sorted(set(c["indices"]))
        assert all(0 <= i < c["n"] for i in c["indices"])


def keep_only(preset: str, method: str, case: dict) -> list[int]:
    n = case["n"]
    t = inputs(method, case)
    st = stage(preset, n, case["kept"])
    res = st(t["hidden"].unsqueeze(0), R.layout(n), None, None, None, R.prompt(n))
    return R.image_kept(res.kept_index, n)


@pytest.mark.parametrize("case", cases("cdpruner"))
def test_cdpruner_keeps_the_authors_tokens(case):
    assert keep_only("cdpruner", "cdpruner", case) == case["indices"]


def test_cdpruner_pos_is_the_same_method_with_the_sign_flipped():
    pos, paper = lightkv.load("cdpruner-pos"), lightkv.load("cdpruner")
    assert paper.pruner.negate and replace(pos, name=paper.name) == replace(
        paper, pruner=replace(paper.pruner, negate=False)
    )
    case = R.fixture("cdpruner")["cases"][0]
    assert len(set(keep_only("cdpruner-pos", "cdpruner", case)) & set(case["indices"])) < 8


@pytest.mark.parametrize("case", cases("divprune"))
def test_divprune_keeps_the_authors_tokens(case):
    assert keep_only("divprune", "divprune", case) == case["indices"]


@pytest.mark.parametrize("case", cases("eadp"))
def test_eadp_keeps_the_authors_tokens(case):
    assert keep_only("eadp", "eadp", case) == case["indices"]


@pytest.mark.parametrize("case", cases("mmtok"))
def test_mmtok_keeps_the_authors_tokens(case):
    assert keep_only("mmtok", "mmtok", case) == case["indices"]


@pytest.mark.parametrize(("method", "case"), [
    *(pytest.param("scope", c.values[0], id="scope-" + c.id) for c in cases("scope")),
    *(pytest.param("vispruner", c.values[0], id="vispruner-" + c.id) for c in cases("vispruner")),
])  # fmt: skip
def test_tower_ranked_selection_keeps_the_authors_tokens(method, case):
    n = case["n"]
    t = inputs(method, case)
    st = stage(method, n, case["kept"])
    xi = tower(st, R.cls_row(t["tower"], case.get("scale", 1.0))[:, 1:], n)
    res = st(t["hidden"].unsqueeze(0), R.layout(n), xi, None, None, R.prompt(n))
    assert R.image_kept(res.kept_index, n) == case["indices"]


@pytest.mark.parametrize("case", cases("fastv"))
def test_fastv_keeps_the_authors_tokens(case):
    n = case["n"]
    t = inputs("fastv", case)
    st = stage("fastv", n, case["kept"])
    layout = R.layout(n)
    xi = st.relevance_scores(t["queries"].unsqueeze(0), t["keys"].unsqueeze(0), layout)
    hidden = torch.zeros(1, R.seq_len(n), 4)
    res = st(hidden, layout, xi, None, None, R.prompt(n))
    assert R.image_kept(res.kept_index, n) == case["indices"]


@pytest.mark.parametrize("case", cases("dart"))
def test_dart_keeps_the_authors_tokens(case):
    n = case["n"]
    t = inputs("dart", case)
    st = stage("dart", n, case["kept"])
    keys = t["keys"].transpose(0, 1).unsqueeze(0)  # [1, S, H, d]
    res = st(t["hidden"].unsqueeze(0), R.layout(n), None, None, keys, R.prompt(n))
    assert R.image_kept(res.kept_index, n) == case["indices"]


@pytest.mark.parametrize("case", cases("visionzip"))
def test_visionzip_keeps_and_merges_as_the_authors(case):
    n = case["n"]
    t = inputs("visionzip", case)
    st = stage("visionzip", n, case["kept"])
    xi = tower(st, R.cls_row(t["tower"])[:, 1:], n)
    res = st(t["hidden"].unsqueeze(0), R.layout(n), xi, None, None, R.prompt(n))
    # the authors' LLM sees the CLS token in one of the kept slots; here it is not in the prompt
    assert R.image_kept(res.kept_index, n) == case["indices"]
    assert len(case["indices"]) == case["kept"] - 1
    if "merged8" in case:  # each contextual token: its target plus the mean of those merged in
        where = {int(p) - R.BEFORE: i for i, p in enumerate(res.kept_index[0].tolist())}
        got = torch.stack([res.hidden[0, where[p], :8] for p in case["targets"]])
        torch.testing.assert_close(got, torch.tensor(case["merged8"]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", cases("holov"))
def test_holov_keeps_and_pads_as_the_authors(case):
    n = case["n"]
    t = inputs("holov", case)
    st = stage("holov", n, case["kept"])
    xi = tower(st, R.cls_row(t["tower"], case["scale"])[:, 1:], n)
    res = st(t["hidden"].unsqueeze(0), R.layout(n), xi, None, None, R.prompt(n))
    image = res.layout.vision_mask[0]
    zero = (res.hidden[0] == 0).all(-1) & image
    assert int(image.sum()) == case["kept"]  # the image still fills its budget ...
    assert int(zero.sum()) == case["pads"]  # ... with the authors' zero vectors
    real = res.kept_index[0][image & ~zero] - R.BEFORE
    assert sorted(real.tolist()) == case["indices"]


@pytest.mark.parametrize("case", cases("vscan"))
def test_vscan_scans_and_merges_as_the_authors(case):
    n = case["n"]
    t = inputs("vscan", case)
    st = stage("vscan", n, case["kept"])
    assert st.tower_layers == (5,)  # the local scan reads tower layer 5, as the authors' code
    xi = tower(st, R.cls_row(t["deep"])[:, 1:], n)
    shallow = {5: R.on_image(R.cls_row(t["shallow"])[:, 1:], n)}
    res = st(t["hidden"].unsqueeze(0), R.layout(n), xi, None, None, R.prompt(n), shallow)
    got = R.image_kept(res.kept_index, n)
    if len(case["indices"]) == case["kept"]:
        assert got == case["indices"]
    else:  # the code keeps fewer (floor(kept / 2) not a multiple of its 16 tiles); lightkv fills
        assert len(got) == case["kept"] and set(case["indices"]) < set(got)
        st = replace(st, partitioner=replace(st.partitioner, fill=False))  # the code's count
        res = st(t["hidden"].unsqueeze(0), R.layout(n), xi, None, None, R.prompt(n), shallow)
        assert R.image_kept(res.kept_index, n) == case["indices"]
    if "merged8" in case:  # each kept token: the mean of itself and the tokens merged into it
        image = res.layout.vision_mask[0]
        torch.testing.assert_close(
            res.hidden[0][image][:, :8], torch.tensor(case["merged8"]), rtol=1e-5, atol=1e-5
        )


def adaptive_stage(preset: str, n: int, case: dict):
    """The preset's stage as shipped (adaptive count), or under the knob where the case fixed
    the authors' fraction (``k``), keeping ``case["kept"]`` of ``n``."""
    st = lightkv.load(preset).stages(32)[0]
    assert st.spec.adaptive
    if case.get("k", -1) == -1:
        return st
    return replace(st, spec=replace(st.spec, adaptive=False, removal_ratio=1 - case["kept"] / n))


def pooled(res, n: int) -> list[int]:
    """The kept image tokens, less the one every removed token was merged into (it pools the
    rest) where the image lost any."""
    got = R.image_kept(res.kept_index, n)
    gone = sorted(set(range(n)) - set(got))
    if not gone:
        return got
    hosts = {int(res.kept_index[0, res.remap[0, R.BEFORE + j]]) - R.BEFORE for j in gone}
    assert len(hosts) == 1  # one pooled token per image
    return [i for i in got if i not in hosts]


@pytest.mark.parametrize("case", cases("prumerge-plus"))
def test_prumerge_plus_keeps_the_authors_tokens(case):
    n = case["n"]
    t = inputs("prumerge-plus", case)
    st = adaptive_stage("prumerge-plus", n, case)
    xi = tower(st, R.cls_row(t["tower"], case["scale"])[:, 1:], n)
    hidden = torch.randn(1, R.seq_len(n), 8, generator=torch.Generator().manual_seed(0))
    res = st(hidden, R.layout(n), xi, None, None, R.prompt(n))
    assert pooled(res, n) == case["indices"]
    assert int(res.layout.vision_mask.sum()) == case["kept"]


@pytest.mark.parametrize("case", cases("trim"))
def test_trim_keeps_the_authors_tokens(case):
    n = case["n"]
    h = inputs("trim", case)["hidden"] * case["scale"]
    st = adaptive_stage("trim", n, case)
    res = st(h.unsqueeze(0), R.layout(n), None, None, None, R.prompt(n))
    assert pooled(res, n) == case["indices"]
    assert int(res.layout.vision_mask.sum()) == case["kept"]


@pytest.mark.parametrize("case", cases("sparsevlm"))
def test_sparsevlm_keeps_recycles_and_merges_as_the_authors(case):
    """One SparseVLM stage: the raters' attention ranks the image, the top ``k_top`` stay, the
    recycled tokens' clusters sit at their centers, each the plain mean of its members."""
    n = case["n"]
    t = inputs("sparsevlm", case)
    st = stage("sparsevlm", n, case["kept"])
    layout, prompt = R.layout(n), R.prompt(n)
    q, k = t["queries"].unsqueeze(0), t["keys"].unsqueeze(0)
    xi = st.relevance_scores(q, k, layout, prompt=prompt, hidden=t["embeds"].unsqueeze(0))
    res = st(t["hidden"].unsqueeze(0), layout, xi, None, None, prompt)
    got = R.image_kept(res.kept_index, n)
    assert len(got) == case["kept"]
    assert sorted(set(got) - set(case["centers"])) == case["indices"]
    assert sorted(set(got) - set(case["indices"])) == case["centers"]
    where = {int(p) - R.BEFORE: i for i, p in enumerate(res.kept_index[0].tolist())}
    merged = sorted(res.hidden[0, where[c], :8].tolist() for c in case["centers"])
    torch.testing.assert_close(
        torch.tensor(merged), torch.tensor(case["merged8"]), rtol=1e-5, atol=1e-5
    )
