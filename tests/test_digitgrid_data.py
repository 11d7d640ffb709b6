"""DigitGrid-VQA data: determinism, split hygiene, answer correctness, batching."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("sklearn")

from lightkv_lab.tasks.digitgrid.data import (
    BOS_ID,
    EOS_ID,
    IGNORE_INDEX,
    IMAGE_ID,
    PAD_ID,
    QTYPES,
    SEP_ID,
    SPECIAL_TOKENS,
    SPLIT_BOUNDARY,
    VOCAB,
    EpisodeStream,
    GridConfig,
    cell_word,
    collate,
    collate_prompts,
    collate_scenes,
    decode,
    digit_pool,
    encode,
    make_episode,
    make_scene,
    num_image_tokens,
)
from lightkv_lab.tasks.digitgrid.images import _digits

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
seeds = st.integers(min_value=0, max_value=2**32 - 1)
splits = st.sampled_from(["train", "heldout"])
HANDWRITTEN = GridConfig(glyphs="handwritten")  # the split hygiene of sklearn digits
qtypes = st.sampled_from(list(QTYPES))


def expected_answer(grid: torch.Tensor, question: list[str]) -> list[str]:
    """Answer a question by parsing its words and reading the grid (independent of the lib)."""
    g = grid.tolist()
    cells = [(r, c, v) for r, row in enumerate(g) for c, v in enumerate(row)]
    if question[0] == "what":
        r, c = (int(x) - 1 for x in question[3][1:].split("c"))
        v = g[r][c]
        return ["none"] if v < 0 else [NAMES[v]]
    if question[0] == "where":
        d = NAMES.index(question[4])
        hits = [(r, c) for r, c, v in cells if v == d]
        assert len(hits) == 1, "'where' asked about a digit that is not unique"
        r, c = hits[0]
        return [f"r{r + 1}c{c + 1}"]
    if question[0] == "how":
        return [f"n{sum(v >= 0 for _, _, v in cells)}"]
    if question[:3] == ["is", "there", "a"]:
        d = NAMES.index(question[3])
        return ["yes" if any(v == d for _, _, v in cells) else "no"]
    raise AssertionError(f"unknown question {question}")


def same_episode(a, b) -> bool:
    return (
        torch.equal(a.image, b.image)
        and torch.equal(a.grid, b.grid)
        and torch.equal(a.digit_index, b.digit_index)
        and a.question == b.question
        and a.answer == b.answer
        and a.qtype == b.qtype
    )


# --------------------------------------------------------------------------- vocabulary


def test_vocab_is_fixed_and_roundtrips():
    assert len(set(VOCAB)) == len(VOCAB)
    assert list(VOCAB[: len(SPECIAL_TOKENS)]) == ["<pad>", "<bos>", "<eos>", "<image>", "<sep>"]
    assert (PAD_ID, BOS_ID, EOS_ID, IMAGE_ID, SEP_ID) == (0, 1, 2, 3, 4)
    words = ["what", "is", "at", "r2c3", "three", "n5", "yes"]
    assert decode(encode(words)) == words
    assert decode(torch.tensor([BOS_ID, *encode(words), EOS_ID]), skip_special=True) == words
    with pytest.raises(KeyError, match="banana"):
        encode(["banana"])


def test_roles_use_separate_words():
    digits = set(NAMES)
    cells = {f"r{r}c{c}" for r in range(1, 9) for c in range(1, 9)}
    counts = {w for w in VOCAB if w.startswith("n") and w[1:].isdigit()}
    assert cell_word(1, 2) == "r2c3" and cell_word(7, 0) == "r8c1"
    with pytest.raises(ValueError, match="outside"):
        cell_word(8, 0)
    groups = [digits, cells, counts]
    for i, a in enumerate(groups):
        assert a <= set(VOCAB)
        for b in groups[i + 1 :]:
            assert not a & b


# --------------------------------------------------------------------------- determinism


@settings(max_examples=15)
@given(seed=seeds, split=splits)
def test_stream_is_deterministic(seed, split):
    a = EpisodeStream(seed, split).take(4)
    b = EpisodeStream(seed, split).take(4)
    assert all(same_episode(x, y) for x, y in zip(a, b))


@settings(max_examples=15)
@given(seed=seeds, split=splits, qtype=qtypes)
def test_make_episode_is_deterministic(seed, split, qtype):
    a = make_episode(random.Random(seed), split, qtype)
    b = make_episode(random.Random(seed), split, qtype)
    assert same_episode(a, b)


def test_different_seeds_differ():
    a = EpisodeStream(0).take(3)
    b = EpisodeStream(1).take(3)
    assert not all(same_episode(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- splits


def test_digit_pools_are_disjoint_and_cover_all_classes():
    _, targets = _digits()
    train = {i for pool in digit_pool("train") for i in pool}
    held = {i for pool in digit_pool("heldout") for i in pool}
    assert not train & held
    assert max(train) < SPLIT_BOUNDARY <= min(held)
    assert len(train) + len(held) == targets.numel()
    for split in ("train", "heldout"):
        for cls, pool in enumerate(digit_pool(split)):
            assert pool and all(int(targets[i]) == cls for i in pool)


@settings(max_examples=20)
@given(seed=seeds, qtype=qtypes)
def test_episodes_draw_only_from_their_split(seed, qtype):
    _, targets = _digits()
    for split in ("train", "heldout"):
        ep = make_episode(random.Random(seed), split, qtype, HANDWRITTEN)
        used = ep.digit_index[ep.digit_index >= 0]
        if split == "train":
            assert bool((used < SPLIT_BOUNDARY).all())
        else:
            assert bool((used >= SPLIT_BOUNDARY).all())
        # the recorded index matches the class written in the grid, and empties agree
        assert torch.equal(ep.grid >= 0, ep.digit_index >= 0)
        assert torch.equal(targets[used], ep.grid[ep.grid >= 0])


def test_stream_pools_disjoint_over_many_episodes():
    train = {
        int(i)
        for ep in EpisodeStream(3, "train", config=HANDWRITTEN).take(60)
        for i in ep.digit_index.flatten()
        if i >= 0
    }
    held = {
        int(i)
        for ep in EpisodeStream(3, "heldout", config=HANDWRITTEN).take(60)
        for i in ep.digit_index.flatten()
        if i >= 0
    }
    assert train and held and not train & held


# --------------------------------------------------------------------------- answers


@settings(max_examples=60)
@given(seed=seeds, split=splits, qtype=st.one_of(st.none(), qtypes))
def test_answers_match_the_grid(seed, split, qtype):
    ep = make_episode(random.Random(seed), split, qtype)
    if qtype is not None:
        assert ep.qtype == qtype
    assert ep.answer == expected_answer(ep.grid, ep.question)
    n = int((ep.grid >= 0).sum())
    assert 3 <= n <= 8
    encode(ep.question + ep.answer)  # every word is in the vocabulary


@settings(max_examples=30)
@given(seed=seeds)
def test_where_only_for_unique_digits(seed):
    ep = make_episode(random.Random(seed), "train", "where")
    d = NAMES.index(ep.question[4])
    assert int((ep.grid == d).sum()) == 1


def test_answers_match_grid_over_a_stream():
    for ep in EpisodeStream(11, "heldout").take(200):
        assert ep.answer == expected_answer(ep.grid, ep.question)


def test_exists_is_balanced():
    eps = EpisodeStream(5, qtypes=["exists"]).take(400)
    yes = sum(ep.answer == ["yes"] for ep in eps) / len(eps)
    assert abs(yes - 0.5) <= 0.10, yes


def test_what_asks_occupied_and_empty_cells():
    eps = EpisodeStream(6, qtypes=["what"]).take(200)
    none = sum(ep.answer == ["none"] for ep in eps) / len(eps)
    assert 0.35 <= none <= 0.65, none


def test_qtype_mix_covers_all_types():
    counts = Counter(ep.qtype for ep in EpisodeStream(8).take(200))
    assert set(counts) == set(QTYPES)
    assert min(counts.values()) >= 30


# --------------------------------------------------------------------------- images


@settings(max_examples=15)
@given(seed=seeds, split=splits)
def test_image_format_and_occupied_cells_are_brighter(seed, split):
    ep = make_episode(random.Random(seed), split)
    assert ep.image.shape == (3, 64, 64) and ep.image.dtype == torch.float32
    assert float(ep.image.min()) >= 0.0 and float(ep.image.max()) <= 1.0
    cells = ep.image.mean(0).reshape(4, 16, 4, 16).mean(dim=(1, 3))  # [row, col]
    occ, emp = cells[ep.grid >= 0], cells[ep.grid < 0]
    assert float(occ.min()) > float(emp.max())


def test_jitter_tint_and_other_geometry():
    cfg = GridConfig(grid=3, cell=20, jitter=2, tint=0.3, min_digits=1, max_digits=9)
    for ep in EpisodeStream(2, config=cfg).take(30):
        assert ep.image.shape == (3, 60, 60)
        assert ep.grid.shape == (3, 3)
        assert ep.answer == expected_answer(ep.grid, ep.question)
        assert 0.0 <= float(ep.image.min()) and float(ep.image.max()) <= 1.0
    assert num_image_tokens(cfg, patch=4) == 225
    assert num_image_tokens() == 256


def test_bad_arguments():
    with pytest.raises(ValueError):
        make_episode(random.Random(0), "test")
    with pytest.raises(ValueError):
        make_episode(random.Random(0), "train", "describe")
    with pytest.raises(ValueError):
        GridConfig(min_digits=5, max_digits=4)
    with pytest.raises(ValueError):
        EpisodeStream(0, qtypes=[])
    with pytest.raises(ValueError):
        num_image_tokens(patch=5)


# --------------------------------------------------------------------------- collate


@settings(max_examples=15)
@given(seed=seeds, batch=st.integers(1, 5), n_image=st.sampled_from([0, 1, 16, 256]))
def test_collate_layout(seed, batch, n_image):
    eps = EpisodeStream(seed).take(batch)
    out = collate(eps, n_image)
    ids, mask, labels = out["input_ids"], out["attention_mask"], out["labels"]
    assert ids.shape == mask.shape == labels.shape and ids.shape[0] == batch
    assert ids.dtype == mask.dtype == labels.dtype == torch.int64
    assert out["pixel_values"].shape == (batch, 3, 64, 64)
    for i, ep in enumerate(eps):
        assert int((ids[i] == IMAGE_ID).sum()) == n_image
        n = int(mask[i].sum())
        # left padding: zeros then ones
        assert mask[i, : ids.shape[1] - n].eq(0).all() and mask[i, ids.shape[1] - n :].eq(1).all()
        assert ids[i, : ids.shape[1] - n].eq(PAD_ID).all()
        row = ids[i, ids.shape[1] - n :].tolist()
        prompt = [BOS_ID] + [IMAGE_ID] * n_image + [SEP_ID] + encode(ep.question)
        assert row == prompt + encode(ep.answer) + [EOS_ID]
        # labels: -100 everywhere but the answer and <eos>
        lab = labels[i]
        keep = lab != IGNORE_INDEX
        assert int(keep.sum()) == len(ep.answer) + 1
        assert keep[-(len(ep.answer) + 1) :].all()
        assert decode(lab[keep]) == ep.answer + ["<eos>"]
        assert torch.equal(lab[keep], ids[i][keep])
        assert torch.equal(out["pixel_values"][i], ep.image)


@settings(max_examples=10)
@given(seed=seeds, batch=st.integers(1, 5))
def test_collate_prompts_ends_at_the_answer_slot(seed, batch):
    eps = EpisodeStream(seed, "heldout").take(batch)
    out = collate_prompts(eps, 256)
    assert "labels" not in out
    last = [encode(ep.question)[-1] for ep in eps]  # the answer follows the question's last word
    assert out["input_ids"][:, -1].tolist() == last
    assert out["attention_mask"][:, -1].eq(1).all()
    for i, ep in enumerate(eps):
        n = int(out["attention_mask"][i].sum())
        row = out["input_ids"][i, -n:].tolist()
        assert row == [BOS_ID] + [IMAGE_ID] * 256 + [SEP_ID] + encode(ep.question)
    assert int((out["input_ids"] == IMAGE_ID).sum()) == 256 * batch


def test_collate_rejects_empty_batch():
    with pytest.raises(ValueError):
        collate([], 4)


# --------------------------------------------------------------------------- glyphs and scenes


def test_the_default_config_is_the_bundled_models():
    from lightkv_lab.tasks.model import read_grid_config

    assert read_grid_config("digitgrid") == GridConfig()


@settings(max_examples=15, deadline=None)
@given(seed=seeds, glyphs=st.sampled_from(["font", "colour"]))
def test_synthetic_glyphs_draw_every_occupied_cell(seed, glyphs):
    cfg = GridConfig(glyphs=glyphs)
    ep = make_episode(random.Random(seed), "heldout", config=cfg)
    assert ep.answer == expected_answer(ep.grid, ep.question)
    # font/colour glyphs record the class in the index map
    assert torch.equal(ep.digit_index, ep.grid)
    img, k = ep.image, cfg.cell
    for r in range(cfg.grid):
        for c in range(cfg.grid):
            tile = img[:, r * k : (r + 1) * k, c * k : (c + 1) * k]
            if ep.grid[r, c] >= 0:
                assert float(tile.max()) > 0.5  # ink
            else:
                assert float(tile.max()) <= cfg.noise + 1e-6  # background only


def test_colour_glyphs_show_their_class_in_every_patch():
    cfg = GridConfig(glyphs="colour")
    ep = make_episode(random.Random(5), "heldout", "what", cfg)
    hues = {}
    for r, c in (ep.grid >= 0).nonzero().tolist():
        tile = ep.image[
            :, r * cfg.cell + 1 : (r + 1) * cfg.cell - 1, c * cfg.cell + 1 : (c + 1) * cfg.cell - 1
        ]
        dominant = tile.mean((1, 2))
        hues.setdefault(int(ep.grid[r, c]), []).append(dominant / dominant.max())
    for cls, colours in hues.items():  # the same class has the same hue in every cell
        for other in colours[1:]:
            assert torch.allclose(colours[0], other, atol=0.05), cls


@settings(max_examples=10, deadline=None)
@given(seed=seeds, n=st.integers(1, 5))
def test_scene_questions_share_one_image_and_are_right(seed, n):
    scene = make_scene(random.Random(seed), "train", n, GridConfig(glyphs="colour"))
    assert len(scene) == n
    for ep in scene:
        assert ep.image is scene[0].image
        assert ep.answer == expected_answer(ep.grid, ep.question)


def test_collate_scenes_first_question_matches_collate():
    cfg = GridConfig(glyphs="colour")
    scenes = [make_scene(random.Random(s), "train", 3, cfg) for s in range(4)]
    batch = collate_scenes(scenes, 16)
    for i, scene in enumerate(scenes):
        row = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        single = collate([scene[0]], 16)["input_ids"][0].tolist()
        assert row[: len(single)] == single  # the first turn is exactly a single-question row
        labels = batch["labels"][i][batch["attention_mask"][i].bool()].tolist()
        expected = []
        for ep in scene:
            expected += encode(ep.answer) + [EOS_ID]
        assert [t for t in labels if t != IGNORE_INDEX] == expected
    with pytest.raises(ValueError, match="at least one"):
        collate_scenes([], 16)
    with pytest.raises(ValueError, match="glyphs"):
        GridConfig(glyphs="emoji")
