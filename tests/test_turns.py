"""`lightkv.integrations.turns` on the bundled Scenes model: continuations scored over a
(compressed) prefill, and turns carried on one cache, each against an oracle that does not
use the code under test (a plain forward of the whole sequence, step-by-step decoding, a
fresh ``generate`` over the whole conversation)."""

from __future__ import annotations

import pytest
import torch
import transformers

pytest.importorskip("lightkv_lab")

import lightkv
from lightkv.adapters.cache import MaskedCacheLayer
from lightkv.integrations.turns import (
    Turns,
    continuation_tokens,
    new_turn_ids,
    next_turn,
    score_continuations,
)
from lightkv.policies.schedulers import ExplicitSchedule

# transformers 5 takes the cache as `cache` (`past_key_values` is deprecated)
CACHE = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"


@pytest.fixture(scope="module")
def scenes():
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from lightkv.lab import bundled_model

    bundled = bundled_model("scenes")
    model = LlavaForConditionalGeneration.from_pretrained(bundled.path, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(bundled.path)
    processor.tokenizer.padding_side = "left"
    image, qa = bundled.example()
    return model.eval(), processor, image, qa


def _prompt(processor, question: str) -> str:
    content = [{"type": "image"}, {"type": "text", "text": question}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def _identity():
    return lightkv.load("lightkv").with_scheduler(
        ExplicitSchedule(layers=(), removal_ratios=(), windows_per_side=None)
    )


def _batch(scenes):
    """Two prompts of different lengths (the shorter left-padded), continuations of 1 and 3
    tokens (the first the model's own answer)."""
    model, processor, image, qa = scenes
    tok = processor.tokenizer
    prompts = [_prompt(processor, qa["question"]), _prompt(processor, "what is in the scene")]
    conts = [f" {qa['answer']}", " striped checked plain"]
    pairs = [continuation_tokens(tok, p, c) for p, c in zip(prompts, conts)]
    inputs = processor(
        text=[p for p, _ in pairs], images=[image, image], padding=True, return_tensors="pt"
    )
    assert inputs["attention_mask"][1].sum() < inputs["attention_mask"][0].sum()  # padded
    return inputs, [c for _, c in pairs]


def _oracle(model, processor, image, prompt: str, cont: list[int]) -> tuple[float, bool]:
    """One row alone, the whole sequence in one plain forward."""
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([cont])], 1)
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"]
        ).logits
    lp = logits[0, n - 1 : n - 1 + len(cont)].double().log_softmax(-1)
    target = torch.tensor(cont)
    return float(lp[torch.arange(len(cont)), target].sum()), bool((lp.argmax(-1) == target).all())


def test_continuation_tokens_split_the_whole_text():
    class Words:  # a tokenizer of whitespace-separated words, with the space on the word
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [hash(w) % 1000 for w in text.replace(" ", "\0 ").split("\0")]}

    ctx, cont = continuation_tokens(Words(), "a question  ", "answer")
    assert ctx == "a question"
    whole = Words()("a question  answer")["input_ids"]
    assert cont == whole[len(Words()("a question")["input_ids"]) :] and len(cont) == 2


def test_batched_scores_equal_each_row_alone_uncompressed(scenes):
    model, processor, image, qa = scenes
    inputs, conts = _batch(scenes)
    pairs, seconds = score_continuations(model, inputs, conts, pad_id=0)
    prompts = [_prompt(processor, qa["question"]), _prompt(processor, "what is in the scene")]
    for (lp, greedy), prompt, cont in zip(pairs, prompts, conts):
        want_lp, want_greedy = _oracle(model, processor, image, prompt, cont)
        assert lp == pytest.approx(want_lp, abs=1e-4, rel=1e-5)
        assert greedy == want_greedy
    assert pairs[0][1] is True and pairs[1][1] is False  # the model answers its own question
    assert seconds is not None and seconds > 0


def test_identity_session_scores_equal_uncompressed_and_compressed_ones_are_finite(scenes):
    model, *_ = scenes
    inputs, conts = _batch(scenes)
    plain, _ = score_continuations(model, inputs, conts, pad_id=0)
    session = lightkv.apply(_identity(), model)
    same, _ = score_continuations(model, inputs, conts, pad_id=0, session=session)
    assert session.report().kept_vision_fraction == 1.0 and not session.active
    for (a, ga), (b, gb) in zip(plain, same):
        assert a == pytest.approx(b, abs=1e-5, rel=1e-6) and ga == gb
    session = lightkv.apply("lightkv-budget", model)
    squeezed, _ = score_continuations(model, inputs, conts, pad_id=0, session=session)
    assert 0 < session.report().kept_vision_fraction < 1
    assert all(torch.isfinite(torch.tensor(lp)) and lp < 0 for lp, _ in squeezed)
    for b in (0, 1):  # a row compressed in a padded batch scores as it does alone
        alone, _ = score_continuations(model, _row(inputs, b), conts[b : b + 1], 0, session)
        assert alone[0][0] == pytest.approx(squeezed[b][0], abs=1e-4, rel=1e-5)
        assert alone[0][1] == squeezed[b][1]


def test_compressed_chunk_equals_token_by_token_decoding(scenes):
    """The continuation as one chunk over the compressed cache = fed one token at a time."""
    model, *_ = scenes
    inputs, conts = _batch(scenes)
    session = lightkv.apply("lightkv-budget", model)
    row = _row(inputs, 0)
    pairs, _ = score_continuations(model, row, conts[:1], 0, session)
    with session, torch.no_grad():
        out = model(**row, use_cache=True)
        logits = [out.logits[:, -1]]
        mask = row["attention_mask"]
        for t in conts[0][:-1]:
            mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)
            out = model(
                input_ids=torch.tensor([[t]]), attention_mask=mask, use_cache=True,
                **{CACHE: _cache(out)},
            )  # fmt: skip
            logits.append(out.logits[:, -1])
    lp = torch.cat(logits).double().log_softmax(-1)
    want = float(lp[torch.arange(len(conts[0])), torch.tensor(conts[0])].sum())
    assert pairs[0][0] == pytest.approx(want, abs=1e-4, rel=1e-5)


def _cache(out):
    return out["cache"] if out.get("cache") is not None else out.past_key_values


def _row(inputs, b: int) -> dict:
    """Row ``b`` of a processor batch without its left padding."""
    keep = inputs["attention_mask"][b].bool()
    return {
        "input_ids": inputs["input_ids"][b : b + 1, keep],
        "attention_mask": inputs["attention_mask"][b : b + 1, keep],
        "pixel_values": inputs["pixel_values"][b : b + 1],
    }


def _vision_entries(session, cache) -> list[int]:
    """Per compressed layer, the cache entries that hold a vision token of the prompt."""
    vision = session.last_prefill.layout.vision_mask[0]
    out = []
    for layer in cache.layers:
        if isinstance(layer, MaskedCacheLayer) and layer.origin is not None:
            origin = layer.origin[0]
            inside = (origin >= 0) & (origin < vision.numel())
            hit = torch.zeros_like(inside)
            hit[inside] = vision[origin[inside]]
            out.append(int((hit & layer.valid[0]).sum()))
    return out


def _two_turns(scenes, session):
    model, processor, image, qa = scenes
    tok = processor.tokenizer
    prompt = _prompt(processor, qa["question"])
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": qa["question"]}]}
    ]
    args = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tok.pad_token_id}
    turns = Turns(model)
    with session:
        first = turns.ask(
            args, inputs=processor(text=[prompt], images=[image], return_tensors="pt")
        )
        lengths = [layer.keys.shape[-2] for layer in turns.cache.layers]
        vision = _vision_entries(session, turns.cache)
        reply = tok.decode(first[0], skip_special_tokens=True)
        _, _, text = next_turn(processor, messages, prompt, reply, "what is in the scene")
        new = new_turn_ids(tok, text, first[0].tolist())
        before = turns.sequences
        second = turns.ask(args, new_ids=new)
        after = [layer.keys.shape[-2] for layer in turns.cache.layers]
        vision_after = _vision_entries(session, turns.cache)
    return before, new, first, second, lengths, after, vision, vision_after


def test_carried_turns_equal_a_fresh_generate_over_the_whole_conversation(scenes):
    model, processor, *_ = scenes
    before, new, first, second, *_ = _two_turns(scenes, lightkv.apply(_identity(), model))
    assert first.shape[1] >= 1 and second.shape[1] >= 1
    ids = torch.cat([before, torch.tensor([new])], 1)
    with torch.no_grad():  # the oracle: no cache, the whole conversation prefilled at once
        fresh = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=processor(text=["<image>"], images=[scenes[2]], return_tensors="pt")[
                "pixel_values"
            ],
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=processor.tokenizer.pad_token_id,
        )
    assert fresh[0, ids.shape[1] :].tolist() == second[0].tolist()


def test_the_second_turn_reads_the_first_turns_compressed_cache(scenes):
    model, *_ = scenes
    session = lightkv.apply("lightkv-budget", model)
    before, new, first, second, lengths, after, vision, vision_after = _two_turns(scenes, session)
    assert session.num_prefills == 1  # the second turn did not prefill again
    assert 0 < session.report().kept_vision_fraction < 1
    # every layer grew by exactly the tokens fed since: the last reply token and the new turn
    fed = 1 + len(new) + second.shape[1] - 1
    assert [a - b for a, b in zip(after, lengths)] == [fed] * len(lengths)
    assert vision and vision == vision_after  # the compressed vision part is the same
    assert min(vision) < session.last_prefill.layout.vision_mask.sum()


def test_next_turn_appends_what_the_template_adds_after_the_reply(scenes):
    _, processor, _, qa = scenes
    prompt = _prompt(processor, qa["question"])
    content = [{"type": "image"}, {"type": "text", "text": qa["question"]}]
    messages = [{"role": "user", "content": content}]
    got, full, text = next_turn(processor, messages, prompt, " checked ", "and the red one")
    assert [m["role"] for m in got] == ["user", "assistant", "user"]
    assert full == processor.apply_chat_template(got, add_generation_prompt=True, tokenize=False)
    assert full == prompt + " checked" + text and text == " and the red one"


def test_next_turn_without_a_chat_template_and_its_refusals():
    class Plain:
        chat_template = None

    _, full, text = next_turn(Plain(), [], "USER: q ASSISTANT:", "yes", "and?")
    assert (full, text) == (
        "USER: q ASSISTANT: yes USER: and? ASSISTANT:",
        " USER: and? ASSISTANT:",
    )

    class Rewrites:
        chat_template = "x"

        def __init__(self, render):
            self.render = render

        def apply_chat_template(self, messages, **_):
            return self.render(messages)

    with pytest.raises(ValueError, match="renders the earlier turns differently"):
        next_turn(Rewrites(lambda m: "other"), [], "prompt", "yes", "and?")
    with pytest.raises(ValueError, match="does not write the model's reply verbatim"):
        next_turn(Rewrites(lambda m: "prompt [reply] and?"), [], "prompt", "yes", "and?")


def test_new_turn_ids_do_not_repeat_the_end_of_sequence(scenes):
    tok = scenes[1].tokenizer
    eos = tok.eos_token_id
    assert new_turn_ids(tok, f"{tok.eos_token} next", [5, eos]) == new_turn_ids(tok, " next", [5])
    kept = new_turn_ids(tok, f"{tok.eos_token} next", [5, 6])
    assert kept[0] == eos and kept[1:] == new_turn_ids(tok, " next", [5])


def test_turns_refuse_beams_and_a_later_turn_without_tokens(scenes):
    turns = Turns(scenes[0])
    with pytest.raises(ValueError, match="num_beams=1"):
        turns.ask({"num_beams": 2})
    with pytest.raises(ValueError, match="the first turn needs"):
        turns.ask({})
