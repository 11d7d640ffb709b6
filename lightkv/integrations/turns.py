"""Teacher-forced continuations and carried-over turns on one model's KV cache: what the
lmms-eval model's ``loglikelihood`` and ``generate_until_multi_round`` run (torch and
transformers only, no lmms-eval, so it is tested in the normal suite).

```python
from lightkv.integrations.turns import Turns, continuation_tokens, score_continuations
ctx, cont = continuation_tokens(tokenizer, prompt, " an answer")
inputs = processor(text=[ctx], images=[image], return_tensors="pt")
pairs, prefill_s = score_continuations(model, inputs, [cont], pad_id, session)
# [(summed log-probability, is the greedy continuation)]
```

Both put the prompt (text and images) through the model once, inside the session's ``with``
when there is a session: that forward starts from an empty cache, so it is the prefill the
session compresses. What follows reads that compressed cache: the continuations are one
chunk of new tokens after it (`score_continuations`), the later turns of a conversation
are appended to the previous turn's sequence and cache (`Turns`). No later forward
prefills again (a session compresses only a forward that starts from an empty cache), so
every turn sees the vision tokens that the first prefill kept.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .session_log import PrefillTimer

__all__ = [
    "Turns",
    "continuation_tokens",
    "new_turn_ids",
    "next_turn",
    "score_continuations",
]


def continuation_tokens(tokenizer: Any, context: str, continuation: str) -> tuple[str, list[int]]:
    """``(context, continuation ids)``: the context without its trailing whitespace and the
    continuation's tokens as they fall in the tokenised whole.

    Whitespace at the end of the context moves to the continuation, and the continuation's
    tokens are those of ``context + continuation`` after the context's own tokens, so a
    continuation that starts with a space (lmms-eval's ``" answer"``) gets the tokens it has
    in running text (the split lm-evaluation-harness makes).
    """
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    whole = tokenizer(stripped + continuation, add_special_tokens=False)["input_ids"]
    head = tokenizer(stripped, add_special_tokens=False)["input_ids"]
    return stripped, list(whole[len(head) :])


def cache_keyword(model: Any) -> str:
    """The name under which ``model``'s forward takes a KV cache (transformers 5: ``cache``,
    earlier: ``past_key_values``)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The cache a forward or ``generate`` returned (``cache``, or ``past_key_values``)."""
    c = out.get("cache") if hasattr(out, "get") else getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


@torch.no_grad()
def score_continuations(
    model: Any,
    inputs: Mapping[str, Any],
    continuations: Sequence[Sequence[int]],
    pad_id: int,
    session: Any = None,
) -> tuple[list[tuple[float, bool]], float | None]:
    """Per row, the continuation's summed log-probability after the prompt and whether it is
    the greedy continuation, with the prompt prefilled once (compressed by ``session``).

    Args:
        model: a transformers vision-language model.
        inputs: the processor's batch of prompts (``input_ids`` and ``attention_mask``
            ``[B, N]``, left-padded, and the images' tensors), on the model's device.
        continuations: per row, the token ids to score (may be empty: log-probability 0,
            greedy).
        pad_id: the id that fills the continuations' right padding.
        session: a `lightkv.adapters.session.CompressionSession` of ``model`` (entered
            here around both forwards), or None for the uncompressed model.

    Returns:
        ``([(log-probability, greedy)] per row, the prefill's wall seconds)``. Token ``j`` of
        a continuation is predicted by the prompt's last position (``j = 0``) or by the
        continuation's position ``j - 1``; the log-softmax is taken in float64.
    """
    pmask = inputs["attention_mask"]
    dev = pmask.device
    b = pmask.shape[0]
    t = max(1, max(len(c) for c in continuations))
    cont = torch.full((b, t), pad_id, dtype=torch.long, device=dev)
    cmask = torch.zeros((b, t), dtype=pmask.dtype, device=dev)
    for r, c in enumerate(continuations):
        cont[r, : len(c)] = torch.tensor(list(c), dtype=torch.long)
        cmask[r, : len(c)] = 1
    # positions as the model numbers them itself (RoPE: a row's left padding shifts all of
    # its positions alike, which leaves its attention unchanged; Qwen's M-RoPE needs its own)
    nxt: dict[str, Any] = {"input_ids": cont, "attention_mask": torch.cat([pmask, cmask], 1)}
    with (
        session if session is not None else contextlib.nullcontext(),
        PrefillTimer(model) as timer,
    ):
        out = model(**inputs, use_cache=True, logits_to_keep=1)
        nxt[cache_keyword(model)] = returned_cache(out)
        later = model(**nxt, use_cache=True)
    logits = torch.cat([out.logits[:, -1:], later.logits[:, :-1]], 1).double().log_softmax(-1)
    pairs = []
    for r, c in enumerate(continuations):
        lp = logits[r, : len(c)]
        target = cont[r, : len(c)]
        total = float(lp.gather(-1, target[:, None]).sum())
        pairs.append((total, bool((lp.argmax(-1) == target).all())))
    return pairs, timer.seconds


def next_turn(
    processor: Any, messages: list[dict], prompt: str, reply: str, question: str
) -> tuple[list[dict], str, str]:
    """The conversation after the model answered ``reply`` and is asked ``question``.

    Args:
        processor: the model's processor (its chat template, when it has one).
        messages: the conversation so far, ending with a user turn.
        prompt: its rendering so far (the text the cache holds, up to the reply).
        reply: the model's answer to the last user turn, as decoded.
        question: the next user turn's text.

    Returns:
        ``(messages, prompt, new text)``: the conversation with the reply and the question,
        its rendering, and the text to append to the tokens already generated (what the
        rendering adds after the reply: the template's separators, the question, the
        generation prompt). Without a chat template a turn reads ``USER: ... ASSISTANT:``.

    Raises:
        ValueError: a chat template that renders the earlier turns differently once a turn
            is added, or does not write the reply verbatim (the cache cannot be carried).
    """
    reply = reply.strip()
    messages = [
        *messages,
        {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        {"role": "user", "content": [{"type": "text", "text": question}]},
    ]
    if getattr(processor, "chat_template", None):
        full = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        full = f"{prompt} {reply} USER: {question} ASSISTANT:"
    if not full.startswith(prompt):
        raise ValueError(
            "the chat template renders the earlier turns differently once a turn is added: "
            "the cache of the earlier turns cannot be carried to the next one"
        )
    added = full[len(prompt) :]
    at = added.find(reply) if reply else 0
    if at < 0:
        raise ValueError(
            "the chat template does not write the model's reply verbatim: the cache of the "
            "earlier turns cannot be carried to the next one"
        )
    return messages, full, added[at + len(reply) :]


def new_turn_ids(tokenizer: Any, text: str, reply_ids: Sequence[int]) -> list[int]:
    """The tokens of ``text`` (a turn's new text, `next_turn`) to append after a reply whose
    tokens were ``reply_ids``: an end-of-sequence token the template writes after the reply
    is dropped when the reply already ended with it (it is in the sequence once)."""
    eos = getattr(tokenizer, "eos_token", None)
    if eos and reply_ids and reply_ids[-1] == tokenizer.eos_token_id:
        if text.lstrip().startswith(eos):
            text = text.lstrip()[len(eos) :]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class Turns:
    """The turns of one conversation, each appended to the previous turn's sequence with
    that turn's KV cache carried; greedy or sampled, one row.

    Run every turn inside one session's ``with`` (a compressed cache needs the session's
    masks): the first turn's forward is the session's one prefill, so every later turn
    reads the vision tokens it kept.

    Attributes:
        sequences: ``[1, L]`` the conversation's tokens so far (prompts and replies).
        cache: the KV cache of all but the last of them (what ``generate`` returns).
    """

    def __init__(self, model: Any):
        self.model = model
        self.sequences: torch.Tensor | None = None
        self.cache: Any = None

    @torch.no_grad()
    def ask(
        self,
        generate_args: Mapping[str, Any],
        inputs: Mapping[str, Any] | None = None,
        new_ids: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One turn: the first from ``inputs`` (the processor's output for the prompt with
        its images), a later one from ``new_ids`` (the tokens that follow the last reply).
        Returns the reply's token ids ``[1, T]``."""
        if int(generate_args.get("num_beams") or 1) != 1:
            raise ValueError("carried turns keep one cache row per conversation: num_beams=1")
        if self.sequences is None:
            if inputs is None:
                raise ValueError("the first turn needs the processor's inputs")
            call = dict(inputs)
        else:
            if new_ids is None:
                raise ValueError("a later turn needs the new tokens that follow the last reply")
            dev = self.sequences.device
            add = torch.tensor([list(new_ids)], dtype=torch.long, device=dev)
            ids = torch.cat([self.sequences, add], 1)
            call = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            call[cache_keyword(self.model)] = self.cache
        n_in = call["input_ids"].shape[1]
        if call["input_ids"].shape[0] != 1:
            raise ValueError("carried turns take one conversation at a time (batch of 1)")
        out = self.model.generate(**call, **generate_args, return_dict_in_generate=True)
        self.sequences, self.cache = out.sequences, returned_cache(out)
        return out.sequences[:, n_in:]
