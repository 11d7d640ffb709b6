"""LLaVA-NeXT: degenerate high-resolution grids and the reference code's one-span layout."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS
from lightkv_lab.tiny.llava_next import build_llava_next, llava_next_tokens

import lightkv
from lightkv import Pipeline
from lightkv.adapters import apply
from lightkv.adapters.llava_next import LlavaNextAdapter
from lightkv.graph import TokenKind
from lightkv.testing import IMAGE

from .conftest import get_model, tiny_lightkv

EXTREME = [(8, 120), (120, 8), (4, 64), (64, 4)]


@pytest.mark.parametrize("size", EXTREME)
def test_extreme_aspect_ratios_compress_inside_a_session(size):
    model = get_model("llava_next")
    fam = TINY_MODELS["llava_next"]
    batch = fam.collate([fam.row(model, [size])])
    ref = model(**batch).logits
    with apply(tiny_lightkv(), model) as session:
        out = model(**batch)
        gen = model.generate(**batch, max_new_tokens=2, do_sample=False)  # the features path
    assert session.last_prefill is not None and out.logits.shape[1] < ref.shape[1]
    assert gen.shape[1] == batch["input_ids"].shape[1] + 2


def test_extreme_aspect_ratios_in_a_mixed_batch():
    model = get_model("llava_next")
    fam = TINY_MODELS["llava_next"]
    batch = fam.collate([fam.row(model, [(8, 120), (20, 30)]), fam.row(model, [(64, 4)], seed=1)])
    with apply(tiny_lightkv(), model) as session:
        model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert session.records


def _paper_model():
    # LLaVA-NeXT-7B's geometry (336 px tiles of 14 px patches, a 672 x 672 image) with tiny widths
    return build_llava_next(
        image_size=336, patch_size=14, pinpoints=((336, 672), (672, 336), (672, 672)), num_layers=2
    )


def test_reference_layout_is_one_span_and_reproduces_the_paper_counts():
    model = _paper_model()
    n_img = llava_next_tokens(model, (672, 672))
    assert n_img == 576 + 48 * 49  # base grid + 48 rows of 48 tokens and a newline = 2928
    ids = torch.cat(
        [torch.full((1, 3), 5), torch.full((1, n_img), IMAGE), torch.full((1, 4), 6)], dim=1
    )
    inputs = {"input_ids": ids, "image_sizes": torch.tensor([[672, 672]])}
    adapter = LlavaNextAdapter(model)
    native = adapter.build_layout(inputs, None)
    assert native.num_images == 2 and int((native.kind == TokenKind.STRUCTURAL).sum()) == 48
    ref = adapter.reference_layout(inputs, None)
    assert ref.num_images == 1 and int(ref.vision_mask.sum()) == 2928
    pipe = lightkv.load("lightkv-paper")
    assert pipe.layout == "reference"
    results = pipe.run(torch.randn(1, ids.shape[1], 8), ref, num_layers=32)
    assert [int(r.layout.vision_counts()) for r in results] == [1465, 733, 367]


def test_the_session_hands_the_pipeline_layout_to_the_adapter():
    model = get_model("llava_next")
    fam = TINY_MODELS["llava_next"]
    batch = fam.collate([fam.row(model, [(20, 30)])])
    pipe = tiny_lightkv()
    pipe.layout = "reference"
    with apply(pipe, model) as session:
        model(**batch)
    layout = session.last_prefill.layout
    assert int((layout.kind == TokenKind.STRUCTURAL).sum()) == 0 and layout.num_images == 1
    with pytest.raises(ValueError, match="unknown layout"):
        Pipeline(layout="square")
