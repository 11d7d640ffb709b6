"""Mistral3 and Pixtral-LLaVA: grids of any size with [IMG_BREAK] / [IMG_END] row ends.

The oracle walks the prompt with the break and end ids (which the adapter never sees) and
takes each image's grid from ``image_sizes`` and the config, not from the adapter."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS
from lightkv_lab.tiny.pixtral import IMG_BREAK, IMG_END, build_mistral3, build_pixtral_llava

from lightkv import Pipeline
from lightkv.adapters import apply, detect_family, get_adapter
from lightkv.adapters.llava import LlavaAdapter
from lightkv.adapters.mistral3 import Mistral3Adapter, PixtralLlavaAdapter
from lightkv.graph.layout import TokenKind
from lightkv.policies import ExplicitSchedule
from lightkv.testing import IMAGE

from .conftest import get_model, tiny_lightkv

NOTHING = Pipeline(scheduler=ExplicitSchedule(layers=(), windows_per_side=()), name="nothing")
FAMILIES = ["mistral3", "pixtral"]


def _d(model) -> int:
    cfg = model.config
    return cfg.vision_config.patch_size * (
        cfg.spatial_merge_size if cfg.model_type == "mistral3" else 1
    )


def _layout(model, batch, generate=False):
    with apply(NOTHING, model) as session:
        model.generate(**batch, max_new_tokens=1) if generate else model(**batch)
    return session.last_prefill.layout


def _oracle(batch, d):
    """Per image: (batch row, [(position, row, col)] of its placeholders, break/end positions)."""
    ids = batch["input_ids"]
    sizes = iter(batch["image_sizes"].tolist())
    images = []
    for b in range(ids.shape[0]):
        n, i = ids.shape[1], 0
        while i < n:
            if int(ids[b, i]) != IMAGE:
                i += 1
                continue
            h, w = (int(v) // d for v in next(sizes))
            cells, ends, r, c = [], [], 0, 0
            while True:
                t = int(ids[b, i])
                if t == IMAGE:
                    cells.append((i, r, c))
                    c += 1
                elif t in (IMG_BREAK, IMG_END):
                    ends.append((i, r, w))
                    r, c = r + 1, 0
                    if t == IMG_END:
                        break
                i += 1
            assert r == h and len(cells) == h * w
            images.append((b, (h, w), cells, ends))
            i += 1
    assert next(sizes, None) is None
    return images


@pytest.mark.parametrize("name", FAMILIES)
def test_layout_is_the_prompt_grid_of_every_image(name):
    model = get_model(name)
    fam = TINY_MODELS[name]
    batch = fam.collate(fam.examples(model))
    layout = _layout(model, batch)
    images = _oracle(batch, _d(model))
    assert layout.num_images == len(images) == 4
    assert (
        layout.image_grid.tolist()
        == [list(g) for _, g, _, _ in images]
        == [[3, 4], [4, 2], [2, 3], [1, 5]]
    )
    assert layout.image_row.tolist() == [0, 1, 1, 1]
    ids = batch["input_ids"]
    assert torch.equal(layout.vision_mask, ids == IMAGE)
    assert torch.equal(layout.kind == TokenKind.STRUCTURAL, (ids == IMG_BREAK) | (ids == IMG_END))
    for s, (b, _, cells, ends) in enumerate(images):
        for pos, r, c in cells + ends:
            assert int(layout.image[b, pos]) == s
            assert layout.coords[b, pos].tolist() == [r, c]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_model_packs_height_over_d_by_width_over_d_tokens(name):
    model = get_model(name)
    fam = TINY_MODELS[name]
    batch = fam.collate(fam.examples(model))
    feats = model.model.get_image_features(
        batch["pixel_values"], image_sizes=batch["image_sizes"]
    ).pooler_output
    d = 8  # Mistral3: 4 px patches x 2 merge; Pixtral-LLaVA: 8 px patches
    assert _d(model) == d
    assert [int(f.shape[0]) for f in feats] == [
        (h // d) * (w // d) for h, w in batch["image_sizes"].tolist()
    ]
    assert _layout(model, batch, generate=True) == _layout(
        model, batch
    )  # grids read from the prompt


def test_the_patch_merger_keeps_raster_order():
    """Merged token k is the 2 x 2 block at (k // w, k % w) of the patch grid."""
    model = build_mistral3()
    merger = model.model.multi_modal_projector.patch_merger
    hp, wp = 6, 8  # patches of a 24 x 32 image (4 px patches)
    dim = merger.merging_layer.in_features // 4
    feats = torch.zeros(hp * wp, dim)
    feats[:, 0] = torch.arange(hp).repeat_interleave(wp).float()
    feats[:, 1] = torch.arange(wp).repeat(hp).float()
    with torch.no_grad():
        merger.merging_layer.weight.zero_()
        merger.merging_layer.weight[0, 0] = 1.0  # channel 0 of the block's top-left patch
        merger.merging_layer.weight[1, 4] = (
            1.0  # channel 1 of the block's top-left patch (channel-major unfold)
        )
        out = merger(feats, torch.tensor([[24, 32]]))
    h, w = hp // 2, wp // 2
    assert torch.equal(out[:, 0], (torch.arange(h).repeat_interleave(w) * 2).float())
    assert torch.equal(out[:, 1], (torch.arange(w).repeat(h) * 2).float())


def test_a_prompt_without_breaks_uses_image_sizes():
    model = get_model("mistral3")
    ids = torch.cat(
        [torch.tensor([[5, 6]]), torch.full((1, 12), IMAGE), torch.tensor([[7]])], dim=1
    )
    layout = Mistral3Adapter(model).build_layout(
        {"input_ids": ids, "image_sizes": torch.tensor([[24, 32]])}, None
    )
    assert (
        layout.image_grid.tolist() == [[3, 4]] and not (layout.kind == TokenKind.STRUCTURAL).any()
    )


def test_malformed_prompts_are_refused():
    model = get_model("mistral3")
    adapter = Mistral3Adapter(model)
    good = TINY_MODELS["mistral3"].row(model, [(24, 32)]).input_ids
    sizes = torch.tensor([[24, 32]])
    ragged = good.clone()
    ragged[good.tolist().index(IMG_BREAK) - 1] = IMG_BREAK  # the first row is one token short
    ragged[good.tolist().index(IMG_BREAK)] = IMAGE
    with pytest.raises(ValueError, match=r"rows of equal width"):
        adapter.build_layout({"input_ids": ragged[None], "image_sizes": sizes}, None)
    with pytest.raises(ValueError, match=r"image_sizes give \(4, 3\)"):
        adapter.build_layout(
            {"input_ids": good[None], "image_sizes": torch.tensor([[32, 24]])}, None
        )
    with pytest.raises(ValueError, match="placeholder tokens"):
        adapter.build_layout(
            {"input_ids": good[None], "image_sizes": torch.tensor([[32, 32]])}, None
        )
    with pytest.raises(ValueError, match="need image_sizes"):
        adapter.build_layout({"input_ids": good[None]}, None)
    no_end = good[: len(good) - good.flip(0).tolist().index(IMG_END) - 1]  # cut at [IMG_END]
    with pytest.raises(ValueError, match=r"\[IMG_END\]"):
        adapter.build_layout({"input_ids": no_end[None], "image_sizes": sizes}, None)


def test_pixtral_llava_is_routed_to_the_pixtral_adapter():
    model = get_model("pixtral")
    assert model.config.model_type == "llava" and detect_family(model) == "pixtral"
    assert isinstance(get_adapter(model), PixtralLlavaAdapter)
    with pytest.raises(NotImplementedError, match="Pixtral vision tower.*'pixtral' adapter"):
        LlavaAdapter(model)
    with pytest.raises(
        NotImplementedError, match="for LlavaForConditionalGeneration with a Pixtral"
    ):
        PixtralLlavaAdapter(get_model("llava"))


def test_refusals():
    model = build_pixtral_llava(num_layers=1)
    model.config.vision_feature_select_strategy = "default"
    with pytest.raises(NotImplementedError, match="vision_feature_select_strategy='full'"):
        apply(tiny_lightkv(), model)
    model = build_mistral3(num_layers=1)
    model.config.text_config.sliding_window = 16
    with pytest.raises(NotImplementedError, match="sliding-window.*sliding_window=16"):
        apply(tiny_lightkv(), model)


@pytest.mark.parametrize("name", FAMILIES)
def test_breaks_survive_compression_in_a_mixed_batch(name):
    model = get_model(name)
    fam = TINY_MODELS[name]
    batch = fam.collate(fam.examples(model))
    with apply(tiny_lightkv(), model) as session:
        model.generate(**batch, max_new_tokens=2, do_sample=False)
    first, final = session.last_prefill.layout, session.last_prefill.final_layout
    assert int(final.vision_counts().sum()) < int(first.vision_counts().sum())
    ids = batch["input_ids"]
    for b in range(ids.shape[0]):
        kept = set(final.origin[b][final.origin[b] >= 0].tolist())
        marks = ((ids[b] == IMG_BREAK) | (ids[b] == IMG_END)).nonzero().flatten().tolist()
        assert set(marks) <= kept


def test_pixtral_llava_without_image_sizes_takes_every_image_whole():
    """Without image_sizes the Pixtral tower encodes each padded image whole."""
    model = get_model("pixtral")
    fam = TINY_MODELS["pixtral"]
    batch = fam.collate([fam.row(model, [(24, 32), (24, 32)]), fam.row(model, [(24, 32)], seed=1)])
    del batch["image_sizes"]
    ref = model(**batch).logits
    with apply(NOTHING, model) as session:
        assert torch.equal(model(**batch).logits, ref)
    assert session.last_prefill.layout.image_grid.tolist() == [[3, 4]] * 3
