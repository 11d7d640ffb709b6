"""The released code's model-level quirks (`lightkv.quirks.ReleasedQuirks`), checked against
their definitions with the model's own layers run by hand (the released code is not a
dependency).

* ``renumber_positions``: after every merge the later layers see plain positions
  ``0 .. N'-1`` (Qwen2.5-VL: the same index on all three M-RoPE axes). Reference: the
  unhooked decoder layers called one by one, the merge applied by the recorded pure `Stage`,
  and every later layer given the model's rotary embedding of ``arange(N')``.
* ``unmasked_first_merge``: the first merge layer attends with a full (non-causal) mask.
  Reference: that layer called with an all-true mask.
* ``eager_merge_layers``: the merge layers compute their attention eagerly (softmax in
  float32) in an sdpa model, as the released code's do. Reference: those layers taken from a
  second copy of the model loaded with ``attn_implementation="eager"`` (same weights), with
  additive float masks; float64 logits equal it bit for bit.
Both: nothing removed = the unhooked model, bit for bit; a row alone = the row in a padded
batch; other families refused by name.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv import Pipeline
from lightkv.adapters import apply
from lightkv.policies import ExplicitSchedule
from lightkv.quirks import ReleasedQuirks

from .conftest import assert_rows_match_batch, get_model

FAMILIES = ["llava", "qwen2_5_vl"]
GEN = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
ALL = ReleasedQuirks(renumber_positions=True, unmasked_first_merge=True, eager_merge_layers=True)
QUIRKS = {
    "renumber": ReleasedQuirks(renumber_positions=True),
    "unmasked": ReleasedQuirks(unmasked_first_merge=True),
    "eager": ReleasedQuirks(eager_merge_layers=True),
    "both": ReleasedQuirks(renumber_positions=True, unmasked_first_merge=True),
    "all": ALL,
}
SCHEDULE = ExplicitSchedule(layers=(1, 2), windows_per_side=(2, 1), removal_ratios=(0.5,))


def released(
    quirks: ReleasedQuirks = ALL, schedule=SCHEDULE, preset: str = "lightkv-paper"
) -> Pipeline:
    return dataclasses.replace(
        lightkv.load(preset).with_scheduler(schedule), released_quirks=quirks
    )


def _batch(family: str, model, rows=((1, 0),)):
    """One row per ``(images, seed)``; Qwen's images are 8x8 tokens, so that the first
    stage (2x2 windows) is not skipped by the reference's small-image rule (8 * W^2)."""
    fam = TINY_MODELS[family]
    if family == "qwen2_5_vl":
        return fam.collate([fam.row(model, images=[(1, 16, 16)] * k, seed=s) for k, s in rows])
    return fam.collate([fam.row(model, images=k, seed=s) for k, s in rows])


def _layer_inputs(model, batch):
    """What the unhooked model hands decoder layer 0 (hidden states, full position
    embeddings), read by a temporary hook on this instance."""
    lm = model.model.language_model
    seen = {}

    def grab(module, args, kwargs):
        seen["hidden"] = args[0] if args else kwargs["hidden_states"]
        seen["pos"] = kwargs["position_embeddings"]

    handle = lm.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(**batch)
    finally:
        handle.remove()
    return seen["hidden"], seen["pos"]


def _reference_logits(model, batch, records, quirks: ReleasedQuirks, impl: str, eager_model=None):
    """The definition, by hand, for one unpadded row: each layer called directly; after a
    merge, positions ``arange(N')`` through the model's rotary embedding and a plain causal
    mask; the first merge layer with an all-true mask if unmasked; merges by the recorded
    stages' pure `Stage` on *our* hidden states (which must equal the hooked ones). With
    ``eager_merge_layers``, the merge layers are ``eager_model``'s (the same weights loaded
    with eager attention), as the released code runs them."""
    lm = model.model.language_model
    hidden, pos = _layer_inputs(model, batch)
    full = pos
    stages = {r.layer: r for r in records}
    first = min(stages)
    for i, layer in enumerate(lm.layers):
        n = hidden.shape[1]
        layer_impl = impl
        if quirks.eager_merge_layers and i in stages:
            layer, layer_impl = eager_model.model.language_model.layers[i], "eager"
        mask = None  # sdpa's own causal path, as the unhooked model (no padding)
        if layer_impl == "eager":
            mask = torch.full((1, 1, n, n), torch.finfo(hidden.dtype).min, dtype=hidden.dtype).triu(
                1
            )
        if quirks.unmasked_first_merge and i == first:
            mask = (
                torch.ones(1, 1, n, n, dtype=torch.bool)
                if layer_impl == "sdpa"
                else torch.zeros(1, 1, n, n, dtype=hidden.dtype)
            )
        out = layer(hidden, attention_mask=mask, position_embeddings=pos, use_cache=False)
        hidden = out[0] if isinstance(out, tuple) else out
        if i in stages:
            rec = stages[i]
            assert torch.equal(hidden, rec.hidden), (
                f"layer {i}: the hooked model's layer output differs"
            )
            hidden = rec.stage(hidden, rec.layout, rec.relevance, rec.provenance).hidden
            if (
                quirks.renumber_positions and hidden.shape[1] < full[0].shape[1]
            ):  # once a token has left
                pos = lm.rotary_emb(hidden, torch.arange(hidden.shape[1]).unsqueeze(0))
            else:
                index = rec.result.layout.origin  # original positions, as lightkv-paper keeps them
                pos = tuple(t.gather(1, index[..., None].expand(-1, -1, t.shape[-1])) for t in full)
    return model.lm_head(lm.norm(hidden))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("which", sorted(QUIRKS))
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_equals_the_definition_by_hand(family, which, impl):
    model = get_model(family, impl)
    batch = _batch(family, model)
    quirks = QUIRKS[which]
    with apply(released(quirks), model, record=True) as session:
        out = model(**batch)
    assert [r.layer for r in session.records] == [1, 2]
    assert session.records[-1].result.layout.vision_counts().tolist() != [0]
    want = _reference_logits(
        model, batch, session.records, quirks, impl, get_model(family, "eager")
    )
    assert out.logits.shape == want.shape
    assert torch.equal(out.logits, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_quirk_changes_the_logits_and_the_merge_layer_is_unmasked(family):
    model = get_model(family)
    batch = _batch(family, model)
    with apply(released(ReleasedQuirks()), model, record=True) as plain:
        base = model(**batch).logits
    for which, quirks in QUIRKS.items():
        with apply(released(quirks), model, record=True) as session:
            logits = model(**batch).logits
        # eager attention alone changes float32 rounding only
        assert (logits - base).abs().max() > (1e-9 if which == "eager" else 1e-3)
        # the first merge layer's output (the first stage's input) differs iff it is unmasked
        # or eager (float32 softmax)
        same = torch.equal(session.records[0].hidden, plain.records[0].hidden)
        assert same == (not (quirks.unmasked_first_merge or quirks.eager_merge_layers))


def _first_merge_cache(model, batch, quirks):
    with apply(released(quirks), model) as session:
        cache = model(**batch, use_cache=True).cache
    assert session.last_prefill.stages
    return cache.layers[1].keys, cache.layers[1].values


@pytest.mark.parametrize("family", FAMILIES)
def test_the_unmasked_layer_caches_the_same_keys_and_values(family):
    # the mask changes what the layer outputs, not what it projects and caches
    model = get_model(family)
    batch = _batch(family, model)
    a = _first_merge_cache(model, batch, ReleasedQuirks())
    b = _first_merge_cache(model, batch, ReleasedQuirks(unmasked_first_merge=True))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_removed_is_the_unhooked_model(family, impl):
    # a row keeps its own positions until a token of it has left, and a stage of ratio 0
    # merges nothing, so its layer keeps its causal mask
    model = get_model(family, impl)
    batch = _batch(family, model, rows=((1, 0), (2, 1)))
    schedule = ExplicitSchedule(layers=(1, 2), windows_per_side=(2, 1), removal_ratios=(0.0,))
    want = model.generate(**batch, **GEN)
    with apply(released(ALL, schedule), model):
        got = model.generate(**batch, **GEN)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_row_alone_equals_row_in_padded_batch(family):
    model = get_model(family)
    fam = TINY_MODELS[family]
    rows = [fam.row(model, images=1, seed=0), fam.row(model, images=2, seed=1)]
    with apply(released(ALL), model):
        assert_rows_match_batch(model, fam, fam.collate(rows), rows, GEN)


@pytest.mark.parametrize("which", ["unmasked", "all"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_text_only_row_batched_with_image_rows_is_as_alone(family, which):
    """Issue 40 item 12: the unmasked first merge layer used to unmask every row of the
    batch, a text-only row too (alone it has nothing to merge and stays causal): its logits
    moved by 0.14 (LLaVA) and 0.16 (Qwen2.5-VL) with its batch. Now only rows with vision
    tokens attend both ways; what is left is the kernels' rounding (eager merge layers run
    for the whole batch: float32 softmax rounding on the text-only row, about 1e-7)."""
    model = get_model(family)
    fam = TINY_MODELS[family]
    rows = fam.examples(model)
    image = model.config.image_token_id
    assert [int((r.input_ids == image).sum()) > 0 for r in rows] == [
        True,
        True,
        False,
    ]  # the last is text only
    with apply(released(QUIRKS[which]), model):
        assert_rows_match_batch(model, fam, fam.collate(rows), rows, GEN, atol=1e-6)


def test_a_mixed_batch_under_flash_is_refused_with_its_reason():
    from lightkv import ImageSegment, VisionLayout
    from lightkv.adapters.masks import FLASH
    from lightkv.adapters.released import ReleasedQuirksHook

    hook = ReleasedQuirksHook.__new__(ReleasedQuirksHook)
    hook.first_merge = 1
    layout = VisionLayout.from_segments(2, 12, [ImageSegment(0, 1, (2, 2))])
    with pytest.raises(
        NotImplementedError, match="mixes rows with and without images.*attn_implementation='sdpa'"
    ):
        hook.prefill_mask(1, layout, FLASH, torch.float32)
    both = VisionLayout.from_segments(
        2, 12, [ImageSegment(0, 1, (2, 2)), ImageSegment(1, 3, (2, 2))]
    )
    assert (
        hook.prefill_mask(1, both, FLASH, torch.float32) is None
    )  # no padding: the dense kernel, causal flag off


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_continues_at_the_original_positions(family):
    # the released code decodes from the original length: the first generated token's
    # logits equal a plain forward of prompt + token, with the prompt cache the session built
    model = get_model(family)
    batch = _batch(family, model)
    with apply(released(ALL), model) as session:
        gen = model.generate(**batch, **GEN)
        assert session.num_prefills == 1
    n0 = batch["input_ids"].shape[1]
    assert gen.sequences.shape[1] == n0 + 4
    with apply(released(ALL), model) as session:
        out = model(**batch, use_cache=True)
        step = gen.sequences[:, n0 : n0 + 1]
        kwargs = {}
        if family == "qwen2_5_vl":  # Qwen's decode position: rope_deltas + original length
            kwargs["position_ids"] = (model.model.rope_deltas + n0).view(1, 1, 1).expand(3, 1, 1)
        mask = torch.ones(1, n0 + 1, dtype=torch.long)
        nxt = model(input_ids=step, attention_mask=mask, cache=out.cache, use_cache=True, **kwargs)
    assert torch.allclose(nxt.logits[:, -1], gen.logits[1], atol=1e-5, rtol=0)


def test_quirks_are_refused_on_other_families():
    model = get_model("llava_next")
    with pytest.raises(
        NotImplementedError,
        match=r"supports llava and qwen2_5_vl only, not the 'llava_next'.*lightkv-paper",
    ):
        apply(released(ALL), model)
    apply(released(ReleasedQuirks()), model)  # off: accepted


def test_bad_quirk_values_are_named():
    with pytest.raises(TypeError, match="renumber_positions must be True or False"):
        ReleasedQuirks(renumber_positions=1)
    with pytest.raises(TypeError, match="released_quirks must be a lightkv.quirks.ReleasedQuirks"):
        Pipeline(released_quirks={"renumber_positions": True})


def test_random_relevance_is_a_seeded_per_token_draw():
    """The raw draw (``softmax=False``); the released distribution is in
    tests/policies/test_random_relevance.py."""
    from lightkv import ImageSegment, VisionLayout
    from lightkv.policies import RandomRelevance

    raw = RandomRelevance(softmax=False)
    both = VisionLayout.from_segments(
        2, 30, [ImageSegment(0, 2, (4, 5)), ImageSegment(1, 5, (4, 5))]
    )
    alone = VisionLayout.from_segments(1, 30, [ImageSegment(0, 5, (4, 5))])
    xi = raw.score(None, None, both)
    assert (
        bool((xi[~both.vision_mask] == 0).all()) and bool((xi < 1).all()) and bool((xi >= 0).all())
    )
    # a token's draw depends on its grid position, not on its row or where the image sits
    assert torch.equal(xi[0, 2:22], xi[1, 5:25]) and torch.equal(
        raw.score(None, None, alone)[0], xi[1]
    )
    assert len(set(xi[0, 2:22].tolist())) == 20
    assert not torch.equal(RandomRelevance(seed=1, softmax=False).score(None, None, both), xi)


# ---------------------------------------------------------------------------- eager merge layers
PRESET_QUIRKS = {
    "llava": "lightkv-paper-released",
    "qwen2_5_vl": "lightkv-paper-released-qwen2_5_vl",
}
OFF_TOLERANCE = 1e-6
"""Float64 logits with ``eager_merge_layers`` off vs the released code's eager path: measured
4.5e-8 (LLaVA) and 7.1e-8 (Qwen2.5-VL) on the tiny models (issue 40: 6.6e-7 on Qwen2.5-VL-7B):
the float32 rounding of the merge layers' softmax, nothing else."""


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_merge_layers_equal_the_released_eager_path_bit_for_bit_in_float64(family):
    """The released presets' quirks (their YAML turns all three on) in an sdpa model in
    float64: logits equal, bit for bit, the by-hand run whose merge layers are an eager-loaded
    copy's; with the option off they differ by the float32 softmax rounding only."""
    preset = lightkv.load(PRESET_QUIRKS[family])
    assert preset.released_quirks == ALL
    model, eager = (
        get_model(family, "sdpa", torch.float64),
        get_model(family, "eager", torch.float64),
    )
    batch = _batch(family, model)
    with apply(released(ALL), model, record=True) as session:
        out = model(**batch).logits
    assert out.dtype == torch.float64
    want = _reference_logits(model, batch, session.records, ALL, "sdpa", eager)
    assert torch.equal(out, want)
    with apply(
        released(dataclasses.replace(ALL, eager_merge_layers=False)), model, record=True
    ) as off:
        sdpa = model(**batch).logits
    # the same survivors, the logits apart by the float32 rounding of the merge layers' softmax
    for a, b in zip(off.records, session.records):
        assert torch.equal(a.result.layout.origin, b.result.layout.origin)
    assert 0.0 < (sdpa - want).abs().max().item() < OFF_TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_merge_layers_switch_only_the_merge_layers_during_prefill(family):
    from lightkv.adapters.attention import AttentionWatch

    model = get_model(family)
    batch = _batch(family, model)
    lm = model.model.language_model
    configs = [layer.self_attn.config for layer in lm.layers]
    seen: list[tuple[int, str, int]] = []

    def spy(i):
        def hook(module, args, kwargs):
            q = (args[0] if args else kwargs["hidden_states"]).shape[1]
            seen.append((i, module.config._attn_implementation, q))

        return hook

    with apply(released(ALL), model) as session, AttentionWatch(model) as watch:
        # after the session's: a module's pre-hooks run in the order they were registered
        handles = [
            layer.self_attn.register_forward_pre_hook(spy(i), with_kwargs=True)
            for i, layer in enumerate(lm.layers)
        ]
        try:
            model.generate(**batch, **GEN)
        finally:
            for h in handles:
                h.remove()
    assert session.num_prefills == 1
    prefill = [(i, impl) for i, impl, q in seen if q > 1]
    decode = {impl for i, impl, q in seen if q == 1}
    assert prefill == [(0, "sdpa"), (1, "eager"), (2, "eager"), (3, "sdpa")]
    assert decode == {"sdpa"}
    assert watch.ran["eager"] == 2 and watch.ran["sdpa"] == len(seen) - 2
    # nothing global, nothing left: every module holds its original config object again
    assert [layer.self_attn.config for layer in lm.layers] == configs
    assert all(a is b for a, b in zip((layer.self_attn.config for layer in lm.layers), configs))
    assert model.config.text_config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_merge_layers_leave_the_model_as_before_after_an_error(family):
    """An exception inside the eager merge layer's attention: the config is put back, and the
    model then gives the never-hooked logits bit for bit."""
    model = get_model(family)
    batch = _batch(family, model)
    want = model(**batch).logits
    attn = model.model.language_model.layers[1].self_attn
    original = attn.config

    def boom(module, args):
        assert attn.config._attn_implementation == "eager"
        raise RuntimeError("boom")

    handle = attn.o_proj.register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"), apply(released(ALL), model):
            model(**batch)
    finally:
        handle.remove()
    assert attn.config is original
    assert torch.equal(model(**batch).logits, want)


def test_eager_merge_layers_skip_a_stage_that_merges_nothing():
    model = get_model("llava")
    schedule = ExplicitSchedule(layers=(1, 2), windows_per_side=(2, 1), removal_ratios=(0.0, 0.5))
    with apply(released(ALL, schedule), model) as session:
        pass
    assert session._ctx.released.eager_layers == frozenset({2})


def test_eager_merge_layers_in_yaml_and_schema():
    from lightkv.config import PipelineConfig
    from lightkv.config.errors import ConfigError
    from lightkv.config.schema import json_schema

    cfg = PipelineConfig.from_yaml_text("name: x\nreleased_quirks: {eager_merge_layers: true}\n")
    assert cfg.build().released_quirks.enabled() == ["eager_merge_layers"]
    assert cfg.to_yaml().endswith("released_quirks: {eager_merge_layers: true}\n")
    with pytest.raises(ConfigError, match="eager_merge_layers"):
        PipelineConfig.from_yaml_text("name: x\nreleased_quirks: {eager_merge_layers: 'yes'}\n")
    with pytest.raises(ConfigError, match="did you mean 'eager_merge_layers'"):
        PipelineConfig.from_yaml_text("name: x\nreleased_quirks: {eager_merge_layer: true}\n")
    props = json_schema()["$defs"]["ReleasedQuirksConfig"]["properties"]
    assert (
        props["eager_merge_layers"]["type"] == "boolean"
        and "float32" in props["eager_merge_layers"]["description"]
    )
    with pytest.raises(TypeError, match="eager_merge_layers must be True or False"):
        ReleasedQuirks(eager_merge_layers="yes")
