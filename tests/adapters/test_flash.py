"""FlashAttention-2 (issue 38): every compressed session runs under ``flash_attention_2``.

On this CPU the kernel is `flash_standin.FlashStandIn` (pure torch, FlashAttention-2's
contract: 2-D padding mask, varlen, causal aligned bottom-right), registered in a fixture
under the name lightkv checks. The oracle is the same compressed session under ``sdpa``
(lightkv's 4-D masks, checked elsewhere against masked references): the logits of the
prefill at every real column and of 8 greedy decoding steps agree to rounding (float32
1e-5, float64 1e-10) and the tokens are identical; at ratio 0 the session equals the stock
model under the stand-in bit for bit. The stand-in refuses a 4-D mask and counts them.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.tasks.towers import fit_tower
from lightkv_lab.tiny import TINY_MODELS

from lightkv import Pipeline
from lightkv.adapters import apply, masks
from lightkv.adapters.attention import AttentionWatch, configured_attention
from lightkv.adapters.guards import attention_implementation
from lightkv.presets import PRESETS, get_preset

from .conftest import get_model, identity_pipeline, tiny_lightkv
from .flash_standin import NAME, FlashStandIn, use_flash

TINY_TOWER_DEPTH = 1  # the tiny LLaVA's vision tower (lightkv.testing.common)
DEPTH = 8  # every preset's schedule fits (scaled from 32 layers)
STEPS = 8
GEN = dict(
    max_new_tokens=STEPS,
    min_new_tokens=STEPS,
    do_sample=False,
    output_logits=True,
    return_dict_in_generate=True,
)
FLASH_FAMILIES = [
    f for f in TINY_MODELS if f != "gemma3"
]  # transformers' Gemma 3 has no FlashAttention-2
MODES = {"hidden": None, "pre_llm": "divprune", "cache": "elasticcache", "h2o": "h2o"}
_MODELS: dict = {}


@pytest.fixture
def flash():
    """The stand-in, registered for the test and removed after it."""
    standin = FlashStandIn()
    with standin.registered():
        yield standin


@contextmanager
def flash_attention(model):
    """``model`` under ``flash_attention_2`` inside the block (every config), as before after."""
    before = configured_attention(model)
    use_flash(model)
    try:
        yield model
    finally:
        model.config._attn_implementation = before  # the setter takes {sub-config: implementation}
        assert configured_attention(model) == before


def _deep_llava(dtype=torch.float32):
    if dtype not in _MODELS:
        _MODELS[dtype] = (
            TINY_MODELS["llava"]
            .build(attn_implementation="sdpa", num_layers=DEPTH, dtype=dtype)
            .eval()
        )
    return _MODELS[dtype]


def _preset(name: str, depth: int):
    try:
        pipe = knob_pipeline(name, depth, 0.5)[0]
    except TypeError:  # a budget schedule (lightkv-budget): the preset as it is
        pipe = get_preset(name)
    return fit_tower(pipe, TINY_TOWER_DEPTH)  # VScan's local scan reads a shallow tower layer


def _mode_pipeline(mode: str) -> Pipeline:
    return tiny_lightkv() if MODES[mode] is None else knob_pipeline(MODES[mode], 4, 0.5)[0]


def _run(model, fam, pipe, batch):
    """``(prefill logits at the real columns [R, V], generate output)`` inside one session."""
    with apply(pipe, model, **fam.adapter_options) as session:
        logits = model(**batch).logits
        layout = session.last_prefill.final_layout
        # hidden-state modes return one column per surviving token, the cache modes the prompt's
        real = (
            layout.valid_mask
            if layout is not None and layout.seq_len == logits.shape[1]
            else batch["attention_mask"].bool()
        )
        out = model.generate(**batch, **GEN)
    return logits[real], out


def _assert_flash_equals_sdpa(model, fam, pipe, batch, tol: float) -> None:
    ref_logits, ref = _run(model, fam, pipe, batch)
    with flash_attention(model):
        logits, out = _run(model, fam, pipe, batch)
    assert (logits - ref_logits).abs().max().item() <= tol
    assert len(out.logits) == len(ref.logits) == STEPS
    for a, b in zip(out.logits, ref.logits):
        assert (a - b).abs().max().item() <= tol
    assert torch.equal(out.sequences, ref.sequences)


def _batches(fam, model):
    """Batch 1, and a left-padded batch of two rows with unequal images."""
    rows = fam.examples(model)
    return {"1": fam.collate(rows[:1]), "padded": fam.collate(rows[:2])}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_under_flash_equals_its_sdpa_run(flash, preset):
    model, fam = _deep_llava(), TINY_MODELS["llava"]
    pipe = _preset(preset, DEPTH)
    # lightkv-cover's log(size) per key: the mask route under sdpa, the bias channel here
    for batch in _batches(fam, model).values():
        _assert_flash_equals_sdpa(model, fam, pipe, batch, 1e-5)
    assert flash.counts["calls"] > 0 and flash.counts["masks_4d"] == 0


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_with_proportional_attention_under_flash_equals_its_sdpa_run(flash, preset):
    """Proportional attention switched on in every preset (issue 49: none is refused under
    FlashAttention-2 for it): the merging ones take the bias channel and equal their sdpa
    runs, whose bias rides on the 4-D mask; the others change nothing. The released
    presets' eager merge layers would leave a merge layer's cache without the channel its
    decoding needs: refused, naming the fix."""
    model, fam = _deep_llava(), TINY_MODELS["llava"]
    pipe = replace(_preset(preset, DEPTH), proportional_attention=True)
    if pipe.released_quirks.eager_merge_layers:
        with (
            flash_attention(model),
            pytest.raises(NotImplementedError, match="eager_merge_layers .* channel route"),
        ):
            apply(pipe, model)
        return
    _assert_flash_equals_sdpa(model, fam, pipe, _batches(fam, model)["padded"], 1e-5)
    assert flash.counts["calls"] > 0 and flash.counts["masks_4d"] == 0


def test_the_released_quirks_on_qwen_m_rope_under_flash_equal_the_sdpa_run(flash):
    """Qwen2.5-VL's 3-D M-RoPE with the released code's renumbered positions and its first
    merge layer attending both ways (FlashAttention-2's causal flag off there)."""
    fam = TINY_MODELS["qwen2_5_vl"]
    if "qwen" not in _MODELS:
        _MODELS["qwen"] = fam.build(attn_implementation="sdpa", num_layers=DEPTH).eval()
    model = _MODELS["qwen"]
    preset = _preset("lightkv-paper-released-qwen2_5_vl", DEPTH)
    assert preset.released_quirks.unmasked_first_merge and preset.released_quirks.renumber_positions
    # the kernel's own path: the merge layers under FlashAttention-2 (eager_merge_layers off)
    pipe = replace(
        preset, released_quirks=replace(preset.released_quirks, eager_merge_layers=False)
    )
    _assert_flash_equals_sdpa(model, fam, pipe, _batches(fam, model)["padded"], 1e-5)
    assert flash.counts["masks_4d"] == 0
    assert (
        flash.counts["causal_off"] == 2
    )  # the first merge layer, in the forward and in generate's prefill
    # the preset as shipped: its merge layers run eager with their own 4-D additive masks,
    # which never reach the flash kernel; every other layer stays on it
    calls = flash.counts["calls"]
    _assert_flash_equals_sdpa(model, fam, preset, _batches(fam, model)["padded"], 1e-5)
    assert (
        flash.counts["masks_4d"] == 0
        and flash.counts["causal_off"] == 2
        and flash.counts["calls"] > calls
    )


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FLASH_FAMILIES)
def test_every_family_and_mode_under_flash_equals_its_sdpa_run(flash, family, mode):
    model, fam = get_model(family), TINY_MODELS[family]
    try:
        pipe = _mode_pipeline(mode)
        batches = _batches(fam, model)
        _assert_flash_equals_sdpa(model, fam, pipe, batches["padded"], 1e-5)
    except NotImplementedError as e:  # refused under sdpa too (Qwen3-VL's DeepStack before the LLM)
        assert "DeepStack" in str(e)
        return
    if mode in ("hidden", "pre_llm"):
        _assert_flash_equals_sdpa(model, fam, pipe, batches["1"], 1e-5)
    assert flash.counts["masks_4d"] == 0


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_float64_under_flash_equals_sdpa_to_1e_10(flash, family):
    model, fam = get_model(family, dtype=torch.float64), TINY_MODELS[family]
    for batch in _batches(fam, model).values():
        for mode in ("hidden", "pre_llm"):
            _assert_flash_equals_sdpa(model, fam, _mode_pipeline(mode), batch, 1e-10)


@pytest.mark.parametrize("family", FLASH_FAMILIES)
def test_identity_at_ratio_0_equals_the_stock_model_under_flash_exactly(flash, family):
    model, fam = get_model(family), TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    with flash_attention(model):
        ref, ref_gen = model(**batch).logits, model.generate(**batch, **GEN)
        with apply(identity_pipeline(), model, **fam.adapter_options) as session:
            out = session.to_prompt_positions(model(**batch).logits)
            gen = model.generate(**batch, **GEN)
        assert session.last_prefill.stages, "the stages must have run"
    real = batch["attention_mask"].bool()
    assert torch.equal(out[real], ref[real])
    assert torch.equal(gen.sequences, ref_gen.sequences)
    assert all(torch.equal(a, b) for a, b in zip(gen.logits, ref_gen.logits))


@pytest.mark.parametrize("mode", ["pre_llm", "cache"])
def test_rows_of_different_lengths_run_varlen_without_a_4d_mask(flash, mode):
    """DivPrune before the LLM and ElasticCache keep rows with 1 and 2 images at different
    lengths: under FlashAttention-2 every compressed layer gets a 2-D padding mask (varlen),
    never a 4-D one, and the watch sees only flash_attention_2."""
    model, fam = get_model("llava"), TINY_MODELS["llava"]
    batch = _batches(fam, model)["padded"]
    pipe = _mode_pipeline(mode)
    with flash_attention(model), apply(pipe, model) as session, AttentionWatch(model) as watch:
        out = model(**batch, use_cache=True)
        if mode == "pre_llm":
            kept = session.last_prefill.final_layout.valid_mask.sum(1)
        else:
            kept = torch.stack(
                [
                    layer.valid.sum(1)
                    for layer in out.cache.layers
                    if hasattr(layer, "valid")
                    and layer.valid is not None
                    and not bool(layer.valid.all())
                ]
            )[0]
        varlen_prefill = flash.counts["varlen"]
        model.generate(**batch, **GEN)
    assert kept[0] != kept[1]  # the rows really differ in length
    assert flash.counts["masks_4d"] == 0 and varlen_prefill > 0
    assert set(watch.ran) == {NAME}


def test_what_flash_cannot_compute_is_refused_with_its_reason(flash, monkeypatch):
    model = get_model("llava")
    with flash_attention(model):
        apply(replace(tiny_lightkv(), proportional_attention=True), model)  # the bias channel
        attn = model.model.language_model.layers[2].self_attn
        monkeypatch.setattr(attn, "sliding_window", 16, raising=False)
        with pytest.raises(
            ValueError, match=r"sliding-window layers \[2\]: the kernel measures the window"
        ):
            apply(tiny_lightkv(), model)
    gemma = get_model("gemma3")
    monkeypatch.setattr(gemma.config.text_config, "_attn_implementation", NAME)
    with pytest.raises(
        ValueError, match="'gemma3' family under flash_attention_2: transformers' Gemma 3 has no"
    ):
        apply(tiny_lightkv(), gemma)


@pytest.mark.parametrize("impl", ["flash_attention_3", "paged|eager"])
def test_other_kernels_are_still_refused(impl):
    with pytest.raises(ValueError, match=f"uses '{re.escape(impl)}'"):
        attention_implementation(type("C", (), {"_attn_implementation": impl}))
    for ok in (NAME, "flex_attention"):
        assert attention_implementation(type("C", (), {"_attn_implementation": ok})) == ok


def test_a_row_with_a_hole_between_real_tokens_is_never_handed_to_flash():
    """FlashAttention-2 is causal by column inside each unpadded row: a hole between real
    tokens would be silently skipped over and tokens out of original order would see the
    wrong keys, so the prefill mask refuses both (a lightkv bug if it ever happens); a
    compacted row gives its validity, a hole-free batch None."""
    origin = torch.tensor([[-1, 0, 1, 2], [0, 1, -1, 3]])
    with pytest.raises(RuntimeError, match="hole between real tokens"):
        masks.prefill_mask(origin, origin >= 0, NAME, torch.float32)
    swapped = torch.tensor([[-1, 0, 2, 1]])
    with pytest.raises(RuntimeError, match="out of original order"):
        masks.prefill_mask(swapped, swapped >= 0, NAME, torch.float32)
    compact = torch.tensor([[-1, 0, 1, 2], [0, 1, 2, 3]])
    assert torch.equal(masks.prefill_mask(compact, compact >= 0, NAME, torch.float32), compact >= 0)
    assert masks.prefill_mask(compact[1:], compact[1:] >= 0, NAME, torch.float32) is None
    assert masks.decode_mask(torch.ones(2, 5, dtype=torch.bool), 1, NAME, torch.float32) is None
    with pytest.raises(ValueError, match="FlashAttention-2 takes no 4-D mask"):
        masks.finish_mask(torch.ones(1, 2, 2, dtype=torch.bool), NAME, torch.float32)


def test_the_efficiency_benchmark_runs_stock_and_compressed_under_flash(flash, monkeypatch):
    """``--attn-implementation flash_attention_2`` loads one model that every variant runs:
    the uncompressed prefill and each compressed one dispatch to flash_attention_2 on every
    layer (the stand-in here: the CUDA / flash_attn check and transformers' import check are
    bypassed by building under sdpa and switching, as `use_flash` does), nothing is refused."""
    from lightkv_lab.bench import efficiency as eff
    from lightkv_lab.bench.efficiency import shapes

    monkeypatch.setattr(shapes, "check_attention_available", lambda *a: None)
    fam = TINY_MODELS["llava"]

    def build(attn_implementation="sdpa", **kw):
        model = fam.build(attn_implementation="sdpa", **kw)
        if attn_implementation == NAME:
            use_flash(model)
        return model

    monkeypatch.setitem(TINY_MODELS, "llava", replace(fam, build=build))
    cfg = eff.quick_config(
        models=("llava",),
        presets=("lightkv", "divprune"),
        layers=6,
        heads=1,
        repeats=1,
        warmup=0,
        eager_repeats=0,
        memory=False,
        progress=False,
        attn_implementation=NAME,
        eager_reference=False,
    )
    m = eff.run(cfg)["models"]["llava"]
    assert m["refused"] == {} and set(m["variants"]) == {"uncompressed", "lightkv", "divprune"}
    assert m["attention_implementation"] == NAME and set(m["attention_configured"].values()) == {
        NAME
    }
    for rec in m["variants"].values():
        assert rec["attention"]["ran"] == {NAME: 6} and rec["attention"]["sdpa_kernels"] == 0
    assert flash.counts["masks_4d"] == 0


def test_beam_search_under_flash_keeps_the_sdpa_beams(flash):
    """Beam search reorders the cache rows, and with them each layer's hole mask: the 2-D
    masks built from it give the sdpa run's beams and scores."""
    model, fam = get_model("llava"), TINY_MODELS["llava"]
    batch = _batches(fam, model)["padded"]
    gen = dict(
        max_new_tokens=STEPS,
        min_new_tokens=STEPS,
        num_beams=3,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )

    def beams():
        with apply(tiny_lightkv(), model):
            return model.generate(**batch, **gen)

    ref = beams()
    with flash_attention(model):
        out = beams()
    assert torch.equal(out.sequences, ref.sequences)
    assert (out.sequences_scores - ref.sequences_scores).abs().max().item() <= 1e-5
    assert flash.counts["masks_4d"] == 0 and flash.counts["varlen"] > 0
