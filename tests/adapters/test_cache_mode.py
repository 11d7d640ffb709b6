"""The cache mode inside every family: cache stages (ElasticCache-style merging after a
layer's prefill) and H2O eviction (after prefill and every decoding step).

Invariants: removing nothing is the unhooked model (prefill untouched, decoding exact;
batch 1 and a padded batch; sdpa and eager), a row alone equals the row in a padded batch
(greedy and beam search), every compressed layer's cache holds what was promised at every
decoding step, Gemma 3's sliding layers are refused; and, on LLaVA, H2O's kept set at every
step equals a slow reference that runs the unhooked model with eager attention, keeps each
layer's full attention history and hides evicted entries with a mask.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.adapters import apply
from lightkv.adapters.cache import MaskedCacheLayer
from lightkv.adapters.modes.h2o import H2OMode
from lightkv.graph.layout import TokenKind
from lightkv.methods import h2o_keep
from lightkv.policies import CacheSchedule

from .conftest import decoder_layers, get_model

GEN = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
LAYERS = (0, 1, 3)  # Gemma 3's tiny decoder has a sliding layer at 2


def elastic(ratio: float = 0.5, layers=LAYERS):
    return lightkv.load("elasticcache").with_scheduler(
        CacheSchedule(removal_ratio=ratio, layers=layers)
    )


def h2o(budget: float = 0.5, tokens: str = "all", layers=LAYERS, recent_share: float = 0.5):
    return lightkv.load("h2o").with_mode(
        H2OMode(budget=budget, tokens=tokens, layers=layers, recent_share=recent_share)
    )


NOTHING = {"cache": lambda: elastic(0.0), "h2o": lambda: h2o(budget=10.0)}
METHODS = {
    "elastic": lambda: elastic(0.5),
    "h2o-all": lambda: h2o(0.5, "all"),
    "h2o-vision": lambda: h2o(0.5, "vision"),
}


class CacheLog:
    """Records, after every forward of the language model, each layer's cache."""

    def __init__(self, session):
        self.steps: list[list[tuple[torch.Tensor | None, torch.Tensor | None, int]]] = []
        lm = session.adapter.language_model()
        self.handle = lm.register_forward_hook(self._post, with_kwargs=True)

    def _post(self, module, args, kwargs, output):
        cache = kwargs.get("cache") or kwargs.get("past_key_values")
        self.steps.append(
            [
                (
                    layer.valid.clone()
                    if isinstance(layer, MaskedCacheLayer) and layer.valid is not None
                    else None,
                    layer.origin.clone()
                    if isinstance(layer, MaskedCacheLayer) and layer.origin is not None
                    else None,
                    int(layer.keys.shape[2]),
                )
                for layer in cache.layers
            ]
        )

    def close(self):
        self.handle.remove()


# ---------------------------------------------------------------------------- identity
@pytest.mark.parametrize("method", sorted(NOTHING))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("size", [1, 3])
def test_removing_nothing_is_the_unhooked_model(family, method, attn, size):
    model = get_model(family, attn)
    fam = TINY_MODELS[family]
    rows = fam.examples(model)
    batch = fam.collate(rows[:1] if size == 1 else rows)
    ref = model(**batch).logits
    ref_gen = model.generate(**batch, **GEN)
    with apply(NOTHING[method](), model, **fam.adapter_options) as session:
        out = model(**batch).logits
        gen = model.generate(**batch, **GEN)
    assert torch.equal(out, ref)  # the prefill is not touched
    if method == "cache" and session.last_prefill.layout is not None:
        assert [r.layer for r in session.records] == list(LAYERS)
    assert torch.equal(gen.sequences, ref_gen.sequences)
    for a, b in zip(gen.logits, ref_gen.logits):
        assert (a - b).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------- promises
def promised(method: str, layout, valid_count: int, b: int, t: int) -> int:
    """Real entries of a compressed layer of row ``b`` after forward ``t`` (0: the prefill)."""
    kind, image = layout.kind[b], layout.image[b]
    vision = kind == TokenKind.VISION
    if method == "elastic":
        sizes = [int((vision & (image == i)).sum()) for i in torch.unique(image[vision]).tolist()]
        return valid_count - sum(min(n // 2, n - 1) for n in sizes) + t
    if method == "h2o-all":
        return min(valid_count + t, math.floor(0.5 * valid_count))
    nv = int(vision.sum())
    return valid_count - nv + min(nv, math.floor(0.5 * nv)) + t


@pytest.mark.parametrize("method", sorted(METHODS))
def test_cache_lengths_as_promised_at_every_decoding_step(family, method):
    model = get_model(family)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    with apply(METHODS[method](), model, **fam.adapter_options) as session:
        log = CacheLog(session)
        try:
            gen = model.generate(**batch, max_new_tokens=4, do_sample=False)
        finally:
            log.close()
        report = session.report()
    layout = session.last_prefill.layout
    n0 = batch["input_ids"].shape[1]
    counts = batch["attention_mask"].sum(1).tolist()
    assert len(log.steps) == gen.shape[1] - n0
    for t, layers in enumerate(log.steps):
        for i, (valid, origin, width) in enumerate(layers):
            if i not in LAYERS or layout is None:
                assert valid is None, (t, i)  # untouched (Gemma 3: its own sliding-window cache)
                continue
            assert valid.shape[1] == width == int(valid.sum(1).max()), (
                t,
                i,
            )  # as few holes as needed
            assert ((origin >= 0) == valid).all()
            for b in range(len(counts)):
                assert int(valid[b].sum()) == promised(method, layout, counts[b], b, t), (
                    method,
                    t,
                    i,
                    b,
                )
    if layout is not None:
        assert report.kv_bytes < report.kv_bytes_baseline


# ---------------------------------------------------------------------------- rows
@pytest.mark.parametrize("method", ["elastic", "h2o-all"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_row_alone_equals_row_in_padded_batch(family, method, attn):
    model = get_model(family, attn)
    fam = TINY_MODELS[family]
    rows = fam.examples(model)
    batch = fam.collate(rows)
    with apply(METHODS[method](), model, **fam.adapter_options):
        together = model.generate(**batch, **GEN)
        for i, row in enumerate(rows):
            single = fam.collate([row])
            alone = model.generate(**single, **GEN)
            new = alone.sequences[0, single["input_ids"].shape[1] :]
            assert torch.equal(
                new, together.sequences[i, batch["input_ids"].shape[1] :][: new.numel()]
            )
            for a, b in zip(alone.logits, together.logits):
                assert (a[0] - b[i]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("method", ["elastic", "h2o-all"])
def test_beam_search_row_alone_equals_row_in_batch(family, method):
    model = get_model(family)
    fam = TINY_MODELS[family]
    if fam.beam_search:
        pytest.skip(fam.beam_search)
    rows = fam.examples(model)
    beams = dict(
        max_new_tokens=4,
        num_beams=3,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with apply(METHODS[method](), model, **fam.adapter_options):
        batch = fam.collate(rows)
        together = model.generate(**batch, **beams)
        for i, row in enumerate(rows):
            single = fam.collate([row])
            alone = model.generate(**single, **beams)
            new = alone.sequences[
                0, single["input_ids"].shape[1] :
            ]  # shorter when it ended with EOS
            assert torch.equal(
                new, together.sequences[i, batch["input_ids"].shape[1] :][: new.numel()]
            )
            assert (
                abs(float(alone.sequences_scores[0]) - float(together.sequences_scores[i])) <= 1e-4
            )


# ---------------------------------------------------------------------------- refusals
def test_gemma3_sliding_layers_are_refused():
    model = get_model("gemma3")
    for pipe in (elastic(layers=None), h2o(layers=None), h2o(layers=(2,))):
        with pytest.raises(
            NotImplementedError,
            match=r"sliding-window layers \[2\].*full-attention layers \(\[0, 1, 3\]\)",
        ):
            apply(pipe, model)


# ---------------------------------------------------------------------------- H2O oracle
def reference_h2o(
    model, batch, tokens, sched: H2OMode, steps: int, vision: torch.Tensor, tokens_at
):
    """Kept positions per step and layer, and logits, from the unhooked eager model: the
    full cache stays, evicted entries are hidden by a per-layer mask, scores are sums over
    the full attention history the model's own attention weights give."""
    layers = list(decoder_layers(model))
    valid0 = batch["attention_mask"].bool()
    b = valid0.shape[0]
    masks: dict[int, torch.Tensor] = {}

    def pre(i, module, args, kwargs):
        if i in masks:
            kwargs["attention_mask"] = masks[i]
        return args, kwargs

    hooks = [
        layer.register_forward_pre_hook(functools.partial(pre, i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        out = model(**batch, use_cache=True, output_attentions=True)
        cand0 = valid0 & vision if tokens == "vision" else valid0
        heavy, recent = sched.counts(cand0.sum(1))
        history = {
            i: [
                torch.where(valid0[:, None, :, None], a, 0.0).sum(dim=(1, 2))
            ]  # padding queries do not count
            for i, a in enumerate(out.attentions)
        }
        alive = {i: valid0.clone() for i in history}
        cand = {i: cand0.clone() for i in history}
        kept, logits = [], [out.logits[:, -1]]
        cache, mask2d = out.past_key_values, batch["attention_mask"]

        def evict():
            for i in alive:
                length = alive[i].shape[1]
                scores = sum(
                    torch.nn.functional.pad(h, (0, length - h.shape[1])) for h in history[i]
                )
                origin = torch.arange(length).expand(b, length)
                alive[i] = (
                    h2o_keep(scores.double(), cand[i] & alive[i], origin, heavy, recent) & alive[i]
                )
            kept.append(
                {
                    i: [set(alive[i][r].nonzero().flatten().tolist()) for r in range(b)]
                    for i in alive
                }
            )

        evict()
        for t in range(1, steps):
            mask2d = torch.cat([mask2d, mask2d.new_ones(b, 1)], dim=1)
            for i in alive:
                allowed = torch.cat([alive[i], torch.ones(b, 1, dtype=torch.bool)], dim=1)
                masks[i] = torch.zeros(b, 1, 1, allowed.shape[1], dtype=model.dtype).masked_fill(
                    ~allowed[:, None, None, :], torch.finfo(model.dtype).min
                )
            out = model(
                input_ids=tokens_at(t),
                attention_mask=mask2d,
                past_key_values=cache,
                use_cache=True,
                output_attentions=True,
            )
            for i, a in enumerate(out.attentions):
                history[i].append(a.sum(dim=(1, 2)))
                alive[i] = torch.cat([alive[i], torch.ones(b, 1, dtype=torch.bool)], dim=1)
                cand[i] = torch.cat([cand[i], torch.full((b, 1), tokens == "all")], dim=1)
            cache = out.past_key_values
            logits.append(out.logits[:, -1])
            evict()
    finally:
        for h in hooks:
            h.remove()
    return kept, logits


@pytest.mark.parametrize("tokens", ["all", "vision"])
@pytest.mark.parametrize("recent_share", [0.5, 0.0])
def test_h2o_kept_set_equals_the_full_history_reference(tokens, recent_share):
    model = get_model("llava", "eager")  # float64 eager gives NaN at padding in transformers
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    steps = 5
    pipe = h2o(0.4, tokens, layers=None, recent_share=recent_share)
    with apply(pipe, model) as session:
        log = CacheLog(session)
        try:
            gen = model.generate(
                **batch,
                max_new_tokens=steps,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                min_new_tokens=steps,
            )
        finally:
            log.close()
    n = batch["input_ids"].shape[1]
    vision = session.last_prefill.layout.kind == TokenKind.VISION
    kept, logits = reference_h2o(
        model,
        batch,
        tokens,
        pipe.mode,
        steps,
        vision,
        lambda t: gen.sequences[:, n + t - 1 : n + t],
    )
    assert len(log.steps) == steps
    for t in range(steps):
        for i, (valid, origin, _) in enumerate(log.steps[t]):
            got = [set(origin[r][valid[r]].tolist()) for r in range(valid.shape[0])]
            assert got == kept[t][i], (t, i)
        assert (gen.logits[t] - logits[t]).abs().max().item() <= 1e-5, t
    # evictions did happen: fewer entries than the prompt's real tokens
    assert sum(len(s) for s in kept[0][0]) < int(batch["attention_mask"].sum())
    if tokens == "all":  # the cache stays at its budget while decoding
        assert [len(s) for s in kept[-1][0]] == [len(s) for s in kept[0][0]]
