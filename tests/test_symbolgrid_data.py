"""SymbolGrid-VQA data: vocabulary, seeded streams, answers checked against the grid by an
independent reading of the rendered image, and the properties that give the benchmark teeth."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightkv_lab.tasks.symbolgrid import data as sg

CONFIG = sg.GridConfig()


def test_vocabulary_has_one_word_per_role():
    assert len(set(sg.VOCAB)) == len(sg.VOCAB)
    assert list(sg.VOCAB[:5]) == ["<pad>", "<bos>", "<eos>", "<image>", "<sep>"]
    assert len(sg.SYMBOL_WORDS) == 32
    roles = [set(sg.SYMBOL_WORDS), set(sg.CELL_WORDS), set(sg.COUNT_WORDS)]
    assert all(not (a & b) for i, a in enumerate(roles) for b in roles[i + 1 :])
    assert sg.cell_word(4, 6) == "r5c7"


def test_streams_are_seeded_and_splits_differ():
    a = sg.EpisodeStream(3, "heldout").take(6)
    b = sg.EpisodeStream(3, "heldout").take(6)
    c = sg.EpisodeStream(3, "train").take(6)
    assert all(torch.equal(x.image, y.image) and x.question == y.question for x, y in zip(a, b))
    assert not all(torch.equal(x.grid, y.grid) for x, y in zip(a, c))


def _read_cells(image: torch.Tensor, config: sg.GridConfig) -> torch.Tensor:
    """An independent reader: each cell's colour is the hue of its brightest pixels, its shape
    the 4x4 ink pattern nearest to the four drawn by hand here."""
    g, cell = config.grid, config.cell
    shapes = torch.tensor(
        [
            [[0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]],  # bar
            [[0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 1, 0]],  # post
            [[0, 0, 0, 0], [0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]],  # dot
            [[1, 1, 1, 1], [1, 0, 0, 1], [1, 0, 0, 1], [1, 1, 1, 1]],  # ring
        ],
        dtype=torch.float32,
    )
    out = torch.empty(g, g, dtype=torch.int64)
    for r in range(g):
        for c in range(g):
            px = image[:, r * cell : (r + 1) * cell, c * cell : (c + 1) * cell]
            ink = px.max(0).values  # [4, 4]
            shape = int(((ink > 0.4).float() - shapes).abs().sum((1, 2)).argmin())
            rgb = px.reshape(3, -1)[:, ink.flatten().argmax()]
            hue = _hue(rgb)
            colour = round(hue * 8) % 8
            out[r, c] = colour * 4 + shape
    return out


def _hue(rgb: torch.Tensor) -> float:
    r, g, b = rgb.tolist()
    mx, mn = max(r, g, b), min(r, g, b)
    d = mx - mn
    if d == 0:
        return 0.0
    if mx == r:
        h = ((g - b) / d) % 6
    elif mx == g:
        h = (b - r) / d + 2
    else:
        h = (r - g) / d + 4
    return h / 6


def test_the_image_shows_the_grid():
    for ep in sg.EpisodeStream(1, "heldout").take(4):
        assert torch.equal(_read_cells(ep.image, CONFIG), ep.grid)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), qtype=st.sampled_from(sg.QTYPES))
def test_answers_follow_from_the_grid(seed, qtype):
    ep = sg.make_episode(random.Random(seed), "heldout", qtype, CONFIG)
    g = ep.grid
    if qtype == "what":
        r, c = ep.meta["row"], ep.meta["col"]
        assert ep.question == ["what", "is", "at", f"r{r + 1}c{c + 1}"]
        assert ep.answer == [sg.SYMBOL_WORDS[int(g[r, c])]]
    elif qtype == "read":
        r, c = ep.meta["row"], ep.meta["col"]
        symbols = ep.answer[0::2]
        cells = ep.answer[1::2]
        assert symbols == [sg.SYMBOL_WORDS[int(g[r, c + j])] for j in range(CONFIG.read_len)]
        assert cells == [f"r{r + 1}c{c + j + 1}" for j in range(1, CONFIG.read_len)]
    else:
        k = sg.SYMBOL_WORDS.index(ep.question[-1])
        assert k in ep.rare
        n = int((g == k).sum())
        assert 0 <= n <= CONFIG.max_rare
        assert ep.answer == ([f"n{n}"] if qtype == "count" else ["yes" if n else "no"])


def test_neighbours_differ_and_exists_is_balanced():
    eps = sg.EpisodeStream(5, "train", qtypes=["exists"]).take(200)
    same = sum(int((e.grid[:, 1:] == e.grid[:, :-1]).sum()) for e in eps[:20])
    pairs = 20 * CONFIG.grid * (CONFIG.grid - 1)
    assert (
        same / pairs < 0.1
    )  # a merge of two horizontal neighbours almost always mixes two symbols
    yes = sum(e.answer == ["yes"] for e in eps)
    assert 70 < yes < 130


def test_collate_puts_labels_on_answers_only():
    scene = sg.make_scene(random.Random(0), "train", 3, CONFIG)
    batch = sg.collate_scenes([scene], sg.num_image_tokens(CONFIG))
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    assert int((ids == sg.IMAGE_ID).sum()) == 256
    want = [t for ep in scene for t in sg.encode(ep.answer) + [sg.EOS_ID]]
    assert labels[labels != sg.IGNORE_INDEX].tolist() == want
    single = sg.collate([scene[0]], 256)
    n = single["input_ids"].shape[1]
    assert torch.equal(
        single["input_ids"][0], ids[:n]
    )  # the first turn is a plain single-question row


def test_bad_configs_fail_clearly():
    with pytest.raises(ValueError, match="grid"):
        sg.GridConfig(grid=40)
    with pytest.raises(ValueError, match="read_len"):
        sg.GridConfig(read_len=0)
    with pytest.raises(ValueError, match="patch"):
        sg.num_image_tokens(CONFIG, patch=8)
    with pytest.raises(KeyError, match="not in the SymbolGrid vocabulary"):
        sg.encode(["zebra"])
