"""The context manager: scoped hooks, refusal of nested sessions, clear errors."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv import Pipeline
from lightkv.adapters import SUPPORTED_FAMILIES, apply
from lightkv.adapters.cache import MaskedCacheLayer
from lightkv.policies import ExplicitSchedule

from .conftest import get_model, tiny_lightkv


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_removed_on_exit_and_on_exception():
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    model(**fam.collate(fam.examples(model)[:1]))  # transformers installs its own output hooks once
    before = _hook_count(model)
    with apply(tiny_lightkv(), model) as session:
        assert session.active and _hook_count(model) > before
    assert not session.active and _hook_count(model) == before
    with pytest.raises(ZeroDivisionError), apply(tiny_lightkv(), model):
        1 / 0  # noqa: B018 (the error is the point)
    assert _hook_count(model) == before
    # a failure inside the model's forward also leaves no hooks behind
    batch = fam.collate(fam.examples(model)[:1])
    batch["pixel_values"] = torch.cat([batch["pixel_values"]] * 2)  # more images than placeholders
    with pytest.raises(ValueError, match="do not match"), apply(tiny_lightkv(), model):
        model(**batch)
    assert _hook_count(model) == before
    # and the model works normally afterwards
    model(**fam.collate(fam.examples(model)[:1]))


def test_second_session_on_the_same_model_is_refused():
    model = get_model("llava")
    with apply(tiny_lightkv(), model), pytest.raises(RuntimeError, match="already active"):
        with apply(tiny_lightkv(), model):
            pass
    with apply(tiny_lightkv(), model):  # fine once the first has ended
        pass


def test_unsupported_model_lists_families():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(ValueError) as err:
        apply(tiny_lightkv(), model)
    for name in SUPPORTED_FAMILIES:
        assert name in str(err.value)


def test_unknown_family_name_lists_families():
    with pytest.raises(ValueError, match="supported families"):
        apply(tiny_lightkv(), get_model("llava"), adapter="blip2")


def test_schedule_deeper_than_model_is_rejected():
    from lightkv.policies import ExplicitSchedule

    pipe = Pipeline(scheduler=ExplicitSchedule(layers=(12,), windows_per_side=(1,)))
    with pytest.raises(ValueError, match="layers"):
        apply(pipe, get_model("llava"))


def test_unsupported_attention_implementation(monkeypatch):
    model = get_model("llava")
    monkeypatch.setattr(
        model.model.language_model.config, "_attn_implementation", "flash_attention_3"
    )
    with pytest.raises(ValueError, match="attn_implementation"):
        apply(tiny_lightkv(), model)


def test_compressed_cache_needs_the_session():
    """Decoding a compressed cache after the session ended would silently be wrong: refused."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model)[:1])
    with apply(tiny_lightkv(), model):
        out = model(**batch, use_cache=True)
    cache = out.cache
    assert any(isinstance(layer, MaskedCacheLayer) for layer in cache.layers)
    nxt = out.logits[:, -1:].argmax(-1)
    mask = torch.cat([batch["attention_mask"], torch.ones_like(nxt)], dim=1)
    with pytest.raises(RuntimeError, match="session"):
        model(input_ids=nxt, attention_mask=mask, cache=cache)


def test_plain_forward_decodes_step_by_step_inside_the_session():
    """A hand-written decode loop (prefill, then one token at a time) equals generate()."""
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    with apply(tiny_lightkv(), model):
        ref = model.generate(**batch, max_new_tokens=4, do_sample=False)
        mask = batch["attention_mask"]
        pos = mask.long().cumsum(-1) - 1
        out = model(**batch, position_ids=pos.clamp_min(0), use_cache=True)
        cache, tokens = out.cache, []
        for _ in range(4):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=cache)
    assert torch.equal(torch.cat(tokens, dim=1), ref[:, -4:])


def test_crop_is_refused():
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    with apply(tiny_lightkv(), model):
        out = model(**fam.collate(fam.examples(model)[:1]), use_cache=True)
        with pytest.raises(NotImplementedError, match="crop"):
            out.cache.crop(-1)


def test_refused_session_does_not_release_the_active_one():
    model = get_model("llava")
    with apply(tiny_lightkv(), model) as first:
        second = apply(tiny_lightkv(), model)
        with pytest.raises(RuntimeError):
            second.__enter__()
        second.close()
        with pytest.raises(RuntimeError, match="already active"):
            with apply(tiny_lightkv(), model):
                pass
        assert first.active


def test_several_new_tokens_at_once_continue_a_compressed_cache(family):
    """Feeding k tokens in one forward after a compressed prefill equals feeding them one
    by one (the compressed layers get a causal mask over their own holey cache)."""
    model = get_model(family)
    fam = TINY_MODELS[family]
    batch = fam.collate(fam.examples(model))
    extra = torch.randint(
        3, 90, (batch["input_ids"].shape[0], 3), generator=torch.Generator().manual_seed(0)
    )
    pos0 = batch["attention_mask"].long().cumsum(-1) - 1
    kw = {"position_ids": pos0.clamp_min(0)} if family != "qwen2_5_vl" else {}

    def run(step: int):
        with apply(tiny_lightkv(), model, **fam.adapter_options):
            out = model(**batch, use_cache=True, **kw)
            cache, mask, pos, logits = out.cache, batch["attention_mask"], pos0[:, -1:], []
            for s in range(0, 3, step):
                new = extra[:, s : s + step]
                mask = torch.cat([mask, torch.ones_like(new)], dim=1)
                p = pos + 1 + torch.arange(new.shape[1])
                pos = p[:, -1:]
                if family == "qwen2_5_vl":  # text continues after the 3-D positions of the prompt
                    p = (p + model.model.rope_deltas).unsqueeze(0).expand(3, -1, -1)
                args = {"position_ids": p}
                logits.append(model(input_ids=new, attention_mask=mask, cache=cache, **args).logits)
        return torch.cat(logits, dim=1)

    assert (run(1) - run(3)).abs().max().item() <= 1e-4


def test_output_hidden_states_inside_the_session():
    model = get_model("llava")
    fam = TINY_MODELS["llava"]
    batch = fam.collate(fam.examples(model))
    with apply(tiny_lightkv(), model) as session:
        out = model(**batch, output_hidden_states=True)
    widths = [h.shape[1] for h in out.hidden_states]
    final = session.last_prefill.final_layout.seq_len
    assert widths[0] == batch["input_ids"].shape[1] and widths[-1] == final < widths[0]


def test_placeholder_mismatch_has_a_clear_message():
    from lightkv.adapters import get_adapter

    model = get_model("llava")
    ids = torch.full((1, 70), 100)
    with pytest.raises(ValueError, match="64 tokens per image"):
        get_adapter(model).build_layout({"input_ids": ids}, None)


@pytest.mark.parametrize("family", ["llava", "llava_next", "internvl"])
def test_full_feature_strategy_is_refused_with_a_clear_error(family):
    from lightkv_lab.tiny import TINY_MODELS

    model = TINY_MODELS[family].build()
    model.config.vision_feature_select_strategy = "full"
    with pytest.raises(
        NotImplementedError,
        match=f"the {family} adapter supports vision_feature_select_strategy='default'",
    ):
        with lightkv.apply(
            lightkv.load("lightkv").with_scheduler(
                ExplicitSchedule(layers=(1,), windows_per_side=(1,))
            ),
            model,
        ):
            pass
