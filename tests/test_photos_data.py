"""Photos-VQA data and measurements that need no tower weights: question mix, answers
checked against the layout by an independent oracle, regions, seeded sets, the feature
cache (with a tiny random tower), the realism measures on constructed inputs, and the
trainer's rows and per-patch labels."""

from __future__ import annotations

import math
import random

import pytest
import torch
from lightkv_lab.tasks.photos import data as ph
from lightkv_lab.tasks.photos import features, measure
from lightkv_lab.tasks.photos import train as ph_train
from lightkv_lab.tasks.registry import get_task


def test_mix_shares_are_the_stated_ones():
    assert math.isclose(sum(ph.MIX.values()), 1.0)
    assert set(ph.MIX) == set(ph.QTYPES)
    coarse = sum(ph.MIX[q] for q in ph.COARSE_QTYPES)
    assert math.isclose(coarse, 0.65)
    counts = {q: ph.MIX_QTYPES.count(q) for q in ph.QTYPES}
    assert all(math.isclose(counts[q] / len(ph.MIX_QTYPES), ph.MIX[q]) for q in ph.QTYPES)
    assert get_task("photos").asked(ph.DEFAULT_CONFIG) == ph.MIX_QTYPES


def _oracle(ep) -> list[str]:
    """The answer recomputed from the layout, written apart from `data._ask`."""
    lay, q = ep.scene, ep.question
    if ep.qtype == "exists":
        return ["yes" if any(o.kind == q[-1] for o in lay.objects) else "no"]
    if ep.qtype == "scene":
        return [lay.scene]
    if ep.qtype == "colour":
        (ob,) = [o for o in lay.objects if o.kind == q[-1]]
        return [ob.colour]
    if ep.qtype == "kind":
        return [max(lay.objects, key=lambda o: o.size).kind]
    if ep.qtype == "relation":
        (a,) = [o for o in lay.objects if o.kind == q[3]]
        (b,) = [o for o in lay.objects if o.kind == q[6]]
        dx, dy = a.x - b.x, a.y - b.y
        return [("left" if dx < 0 else "right") if abs(dx) > abs(dy) else
                ("above" if dy < 0 else "below")]  # fmt: skip
    if ep.qtype == "read":
        return list(lay.sign[2])
    if ep.qtype == "count":
        return [ph.COUNT_WORDS[sum(d.colour == q[2] for d in lay.dots)]]
    if ep.qtype == "small":
        (ob,) = [o for o in lay.objects if o.kind == q[-1]]
        assert ob.role == "small"
        return [ob.colour]
    raise AssertionError(ep.qtype)


@pytest.mark.parametrize("qtype", ph.QTYPES)
def test_answers_match_an_independent_reading_of_the_layout(qtype):
    rng = random.Random(f"oracle:{qtype}")
    asked = 0
    for _ in range(25):
        lay = ph.make_layout(rng, "train")
        try:
            (ep,) = ph.episodes_for(rng, lay, 1, (qtype,))
        except ValueError:  # only `relation` can fail (no pair apart along one axis)
            assert qtype == "relation"
            continue
        asked += 1
        assert ep.answer == _oracle(ep)
        ph.encode(ep.question + ep.answer)  # every word is in the vocabulary
        kinds = [o.kind for o in lay.objects]
        assert len(set(kinds)) == len(kinds)  # a kind names one object
    assert asked >= 15


def test_regions_cover_what_is_asked():
    rng = random.Random("regions")
    for _ in range(20):
        lay = ph.make_layout(rng, "heldout")
        for qtype in ("colour", "kind", "read", "small"):
            eps = ph.episodes_for(rng, lay, 1, (qtype,))
            region = eps[0].meta["region"]
            assert region.shape == (16, 16) and region.any()
        big = lay.role("big")[0]
        # the big object's centre patch is in its region (a ring's centre is its hole)
        (ep,) = ph.episodes_for(rng, lay, 1, ("kind",))
        assert bool(ep.meta["region"][big.y // 14, big.x // 14]) == (big.kind != "ring")
        side = big.size / 14
        assert 0.3 * side**2 <= int(ep.meta["region"].sum()) <= (side + 2) ** 2


def test_sets_are_seeded_and_splits_differ():
    a = features.image_set("heldout", 3, 4)
    assert a == features.image_set("heldout", 3, 4)
    assert a != features.image_set("train", 3, 4)
    assert features.image_set("heldout", 3, 6)[:4] == a  # a longer set extends a shorter one


def test_images_are_photographs_in_range():
    img = ph.render_image(features.image_set("train", 0, 1)[0])
    assert img.shape == (3, 224, 224) and img.dtype == torch.float32
    assert 0.0 <= float(img.min()) and float(img.max()) <= 1.0
    assert float(img.std()) > 0.05


def test_cls_concentration_on_known_rows():
    n = 256
    uniform = torch.full((1, n), 1.0 / n)
    onehot = torch.zeros(1, n)
    onehot[0, 7] = 1.0
    c = measure.cls_concentration(torch.cat([uniform, onehot]))
    k = round(0.11 * n)
    assert c["k"] == k == 28
    torch.testing.assert_close(c["entropy"], torch.tensor([1.0, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(c["top_mass"], torch.tensor([k / n, 1.0]))


def test_near_duplicates_on_constructed_tokens():
    gen = torch.Generator().manual_seed(0)
    side, d = 8, 64
    random_tokens = torch.randn(2, side * side, d, generator=gen)
    assert measure.feature_near_duplicates(random_tokens, side, 2)["share"] == 0.0
    # each 4 x 4 window holds one token repeated (plus the image mean, which centring removes)
    base = torch.randn(4, d, generator=gen)
    cells = torch.arange(side)
    window = ((cells[:, None] // 4) * 2 + cells[None, :] // 4).reshape(-1)
    tokens = base[window][None] + 0.001 * torch.randn(1, side * side, d, generator=gen)
    assert measure.feature_near_duplicates(tokens, side, 2)["share"] == 1.0
    with pytest.raises(ValueError, match="must divide"):
        measure.feature_near_duplicates(tokens, side, 3)


def _tiny_tower():
    from lightkv_lab.tasks.photos.tower import tower_config
    from transformers import Dinov2Model

    torch.manual_seed(0)
    cfg = tower_config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    return Dinov2Model(cfg).eval()


def test_feature_cache_is_content_keyed_and_reused(tmp_path):
    tower = _tiny_tower()
    tower.set_attn_implementation("eager")
    lays = features.image_set("train", 0, 3)
    got = features.cached_features(lays, tmp_path, tower=tower, tower_id="tiny")
    assert got["features"].shape == (3, 256, 32) and got["features"].dtype == torch.float16
    assert got["cls"].shape == (3, 2, 256)
    torch.testing.assert_close(got["cls"].sum(-1), torch.ones(3, 2))
    files = sorted(tmp_path.iterdir())
    assert len(files) == 1 and not list(tmp_path.glob("*.tmp*"))

    class Refuses(torch.nn.Module):
        def forward(self, *a, **k):
            raise AssertionError("the tower ran although the shard was cached")

    again = features.cached_features(lays, tmp_path, tower=Refuses(), tower_id="tiny")
    assert torch.equal(again["features"], got["features"])
    # another layout, another tower or another layer: another file
    keys = {
        features.cache_key(lays, -2, "tiny"),
        features.cache_key(lays[:2], -2, "tiny"),
        features.cache_key(lays, -2, "other"),
        features.cache_key(lays, -1, "tiny"),
    }
    assert len(keys) == 4
    with pytest.raises(ValueError, match="tower_id"):
        features.cached_features(lays, tmp_path, tower=tower)


def test_training_rows_and_patch_labels():
    rng = random.Random("rows")
    lays = features.image_set("train", 0, 2)
    scenes = [ph.episodes_for(rng, lay, 3, ph.QTYPES) for lay in lays]
    batch = ph_train.rows_for(scenes)
    ids, labels = batch["input_ids"], batch["labels"]
    assert int((ids == ph.IMAGE_ID).sum()) == 2 * 256
    for row, scene in zip(range(2), scenes):
        want = [w for ep in scene for w in ph.encode(ep.answer) + [ph.EOS_ID]]
        assert labels[row][labels[row] != -100].tolist() == want
    lab = ph_train.patch_labels(lays[0])
    assert lab.shape == (2, 256)
    big = lays[0].role("big")[0]
    centre = (big.y // 14) * 16 + big.x // 14
    assert ph.VOCAB[int(lab[0, centre])] == big.colour
    assert ph.VOCAB[int(lab[1, centre])] == big.kind
    assert ph.VOCAB[int(lab[0, 0])] in ph.COLOURS + ph.SCENES


def test_training_runs_on_cached_features_and_resumes(tmp_path, monkeypatch):
    """Two steps, stop, resume to three: the checkpoint carries the step, the log and the
    trained part only; export writes a directory without the tower. Features are stand-ins
    (the cache is tested above), so no tower runs."""
    from lightkv_lab.tasks.train import main

    gen = torch.Generator().manual_seed(0)

    def fake_features(layouts, cache_dir, **kw):
        n = len(layouts)
        return {"features": torch.randn(n, 256, 384, generator=gen).half(), "cls": None}

    monkeypatch.setattr(ph_train, "cached_features", fake_features)
    args = [
        "qa", "--task", "photos", "--out", str(tmp_path / "run"), "--images", "8",
        "--text-width", "32", "--text-layers", "1", "--text-ffn", "64", "--batch", "2",
        "--questions", "2", "--steps", "3", "--warmup", "1", "--eval-every", "2",
        "--eval-n", "2", "--ckpt-every", "1", "--aux", "0.5", "--mimetic", "--threads", "1",
    ]  # fmt: skip
    main([*args, "--until", "2"])
    state = torch.load(tmp_path / "run" / "qa.pt", weights_only=False)
    assert state["step"] == 2 and [e["step"] for e in state["log"]] == [2]
    assert not any(k.startswith("model.vision_tower.") for k in state["model"])
    first = {k: v.clone() for k, v in state["model"].items()}
    main([*args, "--export", str(tmp_path / "hf")])
    state = torch.load(tmp_path / "run" / "qa.pt", weights_only=False)
    assert state["step"] == 3
    assert set(state["log"][-1]) >= {"step", "loss", *ph.QTYPES}
    assert any(not torch.equal(first[k], state["model"][k]) for k in first)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size < 1_000_000


def test_draw_skips_images_a_type_cannot_be_asked_of():
    lays = features.image_set("train", 0, 40)
    askable = []
    for i, lay in enumerate(lays):
        try:
            ph.episodes_for(random.Random(0), lay, 1, ("relation",))
            askable.append(i)
        except ValueError:
            pass
    assert 0 < len(askable) < len(lays)  # the set has both kinds of image
    idx, scenes = ph_train._draw(random.Random(1), lays, len(askable), 2, ("relation",), None)
    assert sorted(idx) == askable
    assert all(ep.qtype == "relation" for scene in scenes for ep in scene)
    with pytest.raises(ValueError, match="fewer than"):
        ph_train._draw(random.Random(1), lays, len(askable) + 1, 1, ("relation",), None)


def test_conversations_follow_the_mix_and_ask_a_second_type_of_the_same_image():
    from lightkv_lab.tasks.scoring import conversations

    convs = conversations(3, ph.DEFAULT_CONFIG, seed=5)
    assert [c.first.qtype for c in convs] == list(ph.MIX_QTYPES[:3])
    for c in convs:
        assert c.followup.scene is c.first.scene and c.followup.image is c.first.image
        assert c.followup.qtype != c.first.qtype


def test_code_digest_ignores_prose_and_sees_code():
    src = '"""Module."""\n\nX = 1  # one\n\n\ndef f(a):\n    """Doc."""\n    return a + X\n'
    prose = '"""Other words."""\nX = 1\n\ndef f(a):\n    "Doc, reworded."\n    return a + X\n'
    code = '"""Module."""\n\nX = 2  # one\n\n\ndef f(a):\n    """Doc."""\n    return a + X\n'
    assert features.code_digest(src) == features.code_digest(prose)
    assert features.code_digest(src) != features.code_digest(code)


def test_projector_starts_at_the_word_embeddings_scale():
    """`init_projector` folds the features' statistics into LLaVA's projector: projected tokens
    start with about unit variance per dimension (the default init: ~0.02), whatever the
    features' offset and scale."""
    from lightkv_lab.tasks.photos.model import PhotosSpec, build_model

    gen = torch.Generator().manual_seed(0)
    feats = 3.0 + 0.2 * torch.randn(4, 256, 384, generator=gen) * torch.rand(384, generator=gen)
    spec = PhotosSpec(text_width=64, text_layers=1, text_heads=2, text_ffn=64)
    model = build_model(spec, tower=False)
    proj = model.model.multi_modal_projector
    with torch.no_grad():
        before = float(proj(feats).pow(2).mean())
        ph_train.init_projector(model, feats)
        after = float(proj(feats).pow(2).mean())
    assert before < 0.05
    assert 0.5 < after < 2.0
