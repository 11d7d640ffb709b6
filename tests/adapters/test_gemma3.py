"""Gemma 3: image grids, the bidirectional image mask after merging, sliding windows over
original positions, and the refusals."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS, gemma3

import lightkv
from lightkv.adapters import apply, get_adapter
from lightkv.graph.layout import TokenKind
from lightkv.policies import ExplicitSchedule
from lightkv.testing.common import IMAGE

from .conftest import get_model, identity_pipeline, tiny_lightkv

FAM = TINY_MODELS["gemma3"]
GEN = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)


def _runs(ids: torch.Tensor, token: int) -> list[tuple[int, int, int]]:
    """(row, start, length) of each maximal run of ``token`` (the oracle, by a plain loop)."""
    out = []
    for b, seq in enumerate(ids.tolist()):
        start = None
        for j, t in enumerate(seq + [None]):
            if t == token and start is None:
                start = j
            elif t != token and start is not None:
                out.append((b, start, j - start))
                start = None
    return out


def test_layout_is_one_square_grid_per_image_and_crop():
    model = get_model("gemma3")
    batch = FAM.collate(FAM.examples(model))
    # the oracle: the projector's pooled output per image, and the processor's runs
    with torch.no_grad():
        feats = model.model.get_image_features(batch["pixel_values"]).pooler_output
    per_image = int(feats.shape[1])
    side = int(round(per_image**0.5))
    assert per_image == model.config.mm_tokens_per_image == side * side == 16
    runs = _runs(batch["input_ids"], IMAGE)
    assert [n for _, _, n in runs] == [per_image] * batch["pixel_values"].shape[0] == [16] * 4
    layout = get_adapter(model).build_layout(batch, ~batch["attention_mask"].bool())
    assert torch.equal(layout.vision_mask, batch["input_ids"] == IMAGE)
    assert layout.image_grid.tolist() == [[side, side]] * 4
    assert layout.image_row.tolist() == [b for b, _, _ in runs]
    for k, (b, start, n) in enumerate(runs):
        assert (layout.image[b, start : start + n] == k).all()
        assert layout.coords[b, start : start + n].tolist() == [
            [r, c] for r in range(side) for c in range(side)
        ]
    # begin/end-of-image tokens are text: never merged
    markers = (batch["input_ids"] == gemma3.BOI) | (batch["input_ids"] == gemma3.EOI)
    assert (layout.kind[markers] == TokenKind.TEXT).all()
    with apply(tiny_lightkv(), model) as session:
        model(**batch)
    final = session.last_prefill.final_layout
    for b in range(batch["input_ids"].shape[0]):
        kept = set(final.origin[b][final.origin[b] >= 0].tolist())
        assert set(markers[b].nonzero().flatten().tolist()) <= kept


def _captured_masks(model, pipe, batch):
    """The attention masks each decoder layer receives inside a session, and its last layout."""
    masks, hooks = {}, []
    layers = model.model.language_model.layers
    with apply(pipe, model) as session:
        for i, layer in enumerate(layers):  # registered after the session's: they see its masks
            hooks.append(
                layer.register_forward_pre_hook(
                    lambda m, a, kw, i=i: masks.__setitem__(i, kw["attention_mask"]),
                    with_kwargs=True,
                )
            )
        try:
            model(**batch)
        finally:
            for h in hooks:
                h.remove()
    return masks, session


def test_survivors_of_one_image_see_each_other_both_ways():
    model = get_model("gemma3")
    batch = FAM.collate(FAM.examples(model))
    masks, session = _captured_masks(model, tiny_lightkv(), batch)
    window = model.config.text_config.sliding_window
    types = model.config.text_config.layer_types
    blocks = _block_oracle(batch["token_type_ids"])
    for i, record in zip((2, 3), session.records):  # the compressed layers (sliding, full)
        layout = record.result.layout  # what layer i receives
        mask = masks[i][:, 0]
        b_, n = layout.origin.shape
        for b in range(b_):
            org = layout.origin[b]
            ok = layout.valid_mask[b]
            for q in range(n):
                if not ok[q]:
                    continue
                for k in range(n):
                    if not ok[k]:
                        continue
                    oq, okk = int(org[q]), int(org[k])
                    same = blocks[b][oq] >= 0 and blocks[b][oq] == blocks[b][okk]
                    want = okk <= oq or same
                    if types[i] == "sliding_attention":
                        want = want and okk > oq - window
                    assert bool(mask[b, q, k]) == want, (i, b, q, k)
    # merging happened
    assert int(layout.vision_mask.sum()) < int((batch["input_ids"] == IMAGE).sum())


def _block_oracle(tti: torch.Tensor) -> list[list[int]]:
    out = []
    for seq in tti.tolist():
        ids, cur, prev = [], -1, 0
        for t in seq:
            if t == 1 and prev != 1:
                cur += 1
            ids.append(cur if t == 1 else -1)
            prev = t
        out.append(ids)
    return out


ALTERNATING = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


@pytest.mark.parametrize(
    "layer_types", [ALTERNATING, None]
)  # None: the default 5:1 pattern (4 sliding layers)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_identity_with_uncompressed_sliding_layers_and_decoding_past_the_window(layer_types, attn):
    model = gemma3.build(attn_implementation=attn, layer_types=layer_types, sliding_window=6)
    batch = FAM.collate(FAM.examples(model))
    with torch.no_grad():
        ref = model(**batch).logits
        ref_gen = model.generate(**batch, **GEN)
        with apply(identity_pipeline(), model) as session:
            out = session.to_prompt_positions(model(**batch).logits)
            gen = model.generate(**batch, **GEN)
    valid = batch["attention_mask"].bool()
    assert (out - ref)[valid].abs().max().item() <= 1e-5
    assert torch.equal(gen.sequences, ref_gen.sequences)
    for a, b in zip(gen.logits, ref_gen.logits):
        assert (a - b).abs().max().item() <= 1e-5


def test_without_token_type_ids_the_model_is_causal_and_so_are_the_masks():
    model = get_model("gemma3")
    batch = FAM.collate(FAM.examples(model))
    batch.pop("token_type_ids")
    with torch.no_grad():
        ref = model(**batch).logits
        with apply(identity_pipeline(), model) as session:
            out = session.to_prompt_positions(model(**batch).logits)
    assert (out - ref)[batch["attention_mask"].bool()].abs().max().item() <= 1e-5


def test_compressed_sliding_layer_windows_over_original_positions_while_decoding():
    """A step-by-step decode of a compressed cache: each new token's mask on the sliding
    layer hides exactly the entries whose original column is ``sliding_window`` or more behind."""
    model = get_model("gemma3")
    batch = FAM.collate(FAM.examples(model)[:2])
    window = model.config.text_config.sliding_window
    seen = []
    layer = model.model.language_model.layers[2]
    with apply(tiny_lightkv(), model):

        def record(m, a, kw):
            cl = kw["cache"].layers[2]
            if cl.origin is not None:  # decoding (the cache holds the compressed prompt)
                seen.append((kw["attention_mask"], cl.origin.clone(), cl.valid.clone()))

        hook = layer.register_forward_pre_hook(record, with_kwargs=True)
        try:
            model.generate(**batch, max_new_tokens=3, do_sample=False)
        finally:
            hook.remove()
    n0 = batch["input_ids"].shape[1]
    assert len(seen) == 2
    for step, (mask, origin, valid) in enumerate(seen):
        q = n0 + step  # the new token's column
        assert int(origin.max()) == q - 1
        want = valid & (origin > q - window)
        assert torch.equal(mask[:, 0, -1, :-1], want)
        assert mask[:, 0, -1, -1].all()
        assert (~want & valid).any()  # the window does hide cached entries here


def test_refusals_are_clear():
    pipe = lightkv.load("lightkv").with_scheduler(
        ExplicitSchedule(layers=(1,), windows_per_side=(1,))
    )
    model = gemma3.build()
    model.model.language_model.config.use_bidirectional_attention = True
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention=True"):
        apply(pipe, model)
    model = gemma3.build()
    model.model.language_model.config.layer_types = ["full_attention", "chunked_attention"] * 2
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        apply(pipe, model)
    model = gemma3.build()
    model.config.mm_tokens_per_image = 12
    with pytest.raises(NotImplementedError, match="square image grid; mm_tokens_per_image=12"):
        apply(pipe, model)
