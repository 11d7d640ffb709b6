"""Idefics3 and SmolVLM: one grid per tile and per global view; marker tokens are text.

The oracle walks the prompt with the marker ids (which the adapter never sees) and takes
the tile size from the config."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS
from lightkv_lab.tiny.idefics3 import FAKE, GLOBAL_IMG, LINE, build_idefics3, build_smolvlm, row_col

from lightkv import Pipeline
from lightkv.adapters import apply, detect_family
from lightkv.adapters.idefics3 import Idefics3Adapter
from lightkv.graph.layout import TokenKind
from lightkv.policies import ExplicitSchedule
from lightkv.testing import IMAGE

from .conftest import get_model, tiny_lightkv

NOTHING = Pipeline(scheduler=ExplicitSchedule(layers=(), windows_per_side=()), name="nothing")
FAMILIES = ["idefics3", "smolvlm"]
MARKERS = [FAKE, GLOBAL_IMG, LINE] + [row_col(i, j) for i in range(3) for j in range(4)]


def _side(model) -> int:
    cfg = model.config
    return cfg.vision_config.image_size // cfg.vision_config.patch_size // cfg.scale_factor


def _layout(model, batch, generate=False):
    with apply(NOTHING, model) as session:
        model.generate(**batch, max_new_tokens=1) if generate else model(**batch)
    return session.last_prefill.layout


def _oracle_tiles(ids, per_tile):
    """(batch row, first position) of every tile: placeholders right after a
    ``<row_i_col_j>`` or ``<global-img>`` marker."""
    starts = []
    for b in range(ids.shape[0]):
        for i in range(1, ids.shape[1]):
            if int(ids[b, i]) == IMAGE and int(ids[b, i - 1]) in MARKERS[1:]:
                assert bool((ids[b, i : i + per_tile] == IMAGE).all())
                starts.append((b, i))
    return starts


@pytest.mark.parametrize("name", FAMILIES)
def test_one_grid_per_tile_and_global_view(name):
    model = get_model(name)
    fam = TINY_MODELS[name]
    batch = fam.collate(fam.examples(model))
    layout = _layout(model, batch)
    side = _side(model)
    assert side == 4 and model.model.image_seq_len == 16
    ids = batch["input_ids"]
    tiles = _oracle_tiles(ids, side * side)
    # (2 x 2 + global) in row 0; (1 x 3 + global) and a global view alone in row 1
    assert len(tiles) == layout.num_images == 5 + 4 + 1
    assert layout.image_grid.tolist() == [[side, side]] * len(tiles)
    assert layout.image_row.tolist() == [b for b, _ in tiles]
    assert torch.equal(layout.vision_mask, ids == IMAGE)
    assert not (layout.kind == TokenKind.STRUCTURAL).any()
    markers = torch.isin(ids, torch.tensor(MARKERS))
    assert markers.any() and bool((layout.kind[markers] == TokenKind.TEXT).all())
    raster = torch.stack(
        [torch.arange(side).repeat_interleave(side), torch.arange(side).repeat(side)], dim=1
    )
    for s, (b, start) in enumerate(tiles):
        span = slice(start, start + side * side)
        assert bool((layout.image[b, span] == s).all())
        assert torch.equal(layout.coords[b, span], raster)
    assert (layout.image_video == -1).all()
    assert _layout(model, batch, generate=True) == layout


@pytest.mark.parametrize("name", FAMILIES)
def test_the_model_makes_side_squared_tokens_per_tile(name):
    model = get_model(name)
    fam = TINY_MODELS[name]
    batch = fam.collate(fam.examples(model))
    feats = model.model.get_image_features(batch["pixel_values"]).pooler_output
    # rows hold 5, 4 + 1 and 0 real tiles; the model drops the all-zero padding tiles
    assert [int(f.shape[0]) for f in feats] == [5 * 16, 5 * 16, 0]


@pytest.mark.parametrize("name", FAMILIES)
def test_pixel_shuffle_keeps_raster_order(name):
    """Shuffled token k holds the scale x scale block of patches at (k // side, k % side)."""
    model = get_model(name)
    scale = model.config.scale_factor
    patches = model.config.vision_config.image_size // model.config.vision_config.patch_size
    ids = torch.arange(patches * patches, dtype=torch.float32).reshape(1, -1, 1)
    out = model.model.connector.pixel_shuffle(ids, scale)[0]  # [side^2, scale^2]
    side = patches // scale
    for k in range(side * side):
        i, j = divmod(k, side)
        block = {
            (i * scale + a) * patches + j * scale + b for a in range(scale) for b in range(scale)
        }
        assert set(out[k].long().tolist()) == block


def test_smolvlm_video_frames_are_separate_grids():
    """SmolVLM's video frames reach the model as global views with timestamp text between."""
    model = get_model("smolvlm")
    fam = TINY_MODELS["smolvlm"]
    frames = fam.row(model, [(0, 0)] * 3, seed=3)
    layout = _layout(model, fam.collate([frames]))
    assert (
        layout.num_images == 3
        and (layout.image_video == -1).all()
        and (layout.image_frame == 0).all()
    )


def test_detection_and_refusals():
    assert detect_family(get_model("idefics3")) == detect_family(get_model("smolvlm")) == "idefics3"
    for build in (build_idefics3, build_smolvlm):
        model = build(num_layers=1, image_size=24, patch_size=4, scale_factor=4)  # 6 x 6 patches
        with pytest.raises(
            NotImplementedError, match=r"6 x 6 patch grid to divide by scale_factor=4"
        ):
            Idefics3Adapter(model)
    adapter = Idefics3Adapter(get_model("idefics3"))
    ids = torch.cat([torch.tensor([[5]]), torch.full((1, 17), IMAGE), torch.tensor([[6]])], dim=1)
    with pytest.raises(ValueError, match="not a multiple of 16 tokens per tile"):
        adapter.build_layout({"input_ids": ids}, None)


@pytest.mark.parametrize("name", FAMILIES)
def test_markers_survive_compression(name):
    model = get_model(name)
    fam = TINY_MODELS[name]
    batch = fam.collate(fam.examples(model))
    with apply(tiny_lightkv(), model) as session:
        model.generate(**batch, max_new_tokens=2, do_sample=False)
    first, final = session.last_prefill.layout, session.last_prefill.final_layout
    assert int(final.vision_counts().sum()) < int(first.vision_counts().sum())
    ids = batch["input_ids"]
    markers = torch.isin(ids, torch.tensor(MARKERS))
    for b in range(ids.shape[0]):
        kept = set(final.origin[b][final.origin[b] >= 0].tolist())
        assert set(markers[b].nonzero().flatten().tolist()) <= kept
