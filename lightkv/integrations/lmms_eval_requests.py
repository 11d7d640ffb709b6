"""The likelihood and multi-round requests of lightkv's lmms-eval model (`LightKV` mixes
`ScoringAndRounds` in), and the per-sample token counts it logs. Imports lmms-eval; only
`lightkv.integrations.lmms_eval` imports this module.

``loglikelihood`` (tasks of ``output_type: loglikelihood`` or ``multiple_choice``): the
context with its images is prefilled once, compressed by the session, and the continuation
is read as one chunk over that compressed cache (`lightkv.integrations.turns`); the answer
is the continuation's summed log-probability and whether greedy decoding would produce it,
batched by ``--batch_size``. ``generate_until_multi_round``: one conversation at a time, the
first round's prompt and images prefilled (compressed) once, every later round appended to
the previous round's tokens with its KV cache carried, all inside one ``with`` of the
session. Every sample's lightkv report (the kept vision fraction of its prefill, ...) goes
into the sample log and the aggregate like ``generate_until``'s.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Protocol

from lmms_eval.api.instance import GenerationResult, TokenCounts

from .session_log import PrefillTimer, ReportTotals, row_reports, uncompressed_rows
from .turns import Turns, continuation_tokens, new_turn_ids, next_turn, score_continuations

__all__ = ["LightKVTokenCounts", "LoglikelihoodResult", "ScoringAndRounds", "likelihood_kind"]


def likelihood_kind(value: str) -> str:
    """The model argument ``likelihood``, checked: ``logprob`` or ``nll``."""
    if value not in ("logprob", "nll"):
        raise ValueError(
            f"likelihood={value}: give logprob (the summed log-probability) or nll (its "
            "negative, for lmms-eval 0.7.3's multiple_choice tasks, which pick the smallest)"
        )
    return value


@dataclass
class LightKVTokenCounts(TokenCounts):
    """lmms-eval's per-sample token counts plus the sample's lightkv report (what its
    sample log writes, through ``to_dict``)."""

    lightkv: dict | None = None

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["lightkv"] = self.lightkv
        return out


@dataclass
class LoglikelihoodResult(GenerationResult):
    """One ``loglikelihood`` answer: the ``(log-probability, is_greedy)`` pair of lmms-eval's
    API as ``text``, with the sample's token counts. It unpacks and indexes as the pair.

    A `GenerationResult` because lmms-eval 0.7.3's evaluator passes every answer through
    ``unwrap_generation_output``, which turns a bare ``(float, bool)`` tuple into its string
    (and the task's scoring then fails); a `GenerationResult` reaches the task as its
    ``text``, the pair, and its token counts reach the sample log.
    """

    def __iter__(self):
        return iter(self.text)

    def __getitem__(self, i):
        return self.text[i]

    def __len__(self) -> int:
        return len(self.text)


class _Host(Protocol):
    """What `ScoringAndRounds` uses of the model class it is mixed into (`LightKV`)."""

    _model: Any
    processor: Any
    tokenizer: Any
    session: Any
    task_dict: dict
    totals: dict[str, ReportTotals]
    batch_size_per_gpu: int
    likelihood: str

    @property
    def rank(self) -> int: ...

    def _visuals(self, doc_to_visual, doc_id, task, split) -> list: ...
    def _prompt(self, context: str, n_images: int) -> str: ...
    def _inputs(self, prompts: list[str], images: list[list]) -> dict: ...
    def _generation_args(self, gen_kwargs: dict) -> tuple[dict, list[str]]: ...
    def _cut(self, text: str, until: list[str]) -> str: ...
    def _log_aggregate(self) -> None: ...


def _rows(host: _Host, has_vision: list[bool], inputs, prefill_s) -> list[dict]:
    if host.session is not None:
        return row_reports(host.session, prefill_s)
    prompt = inputs["attention_mask"].sum(-1).tolist()
    return uncompressed_rows(has_vision, [int(p) for p in prompt], prefill_s)


def _count(host: _Host, request, row: dict) -> None:
    if not (request.metadata or {}).get("__padding_only__"):
        for k in ("", request.task_name):
            host.totals.setdefault(k, ReportTotals()).add(row)


class ScoringAndRounds:
    """``loglikelihood`` and ``generate_until_multi_round`` of `LightKV` (which provides
    what `_Host` lists: ``_visuals``, ``_prompt``, ``_inputs``, ``_generation_args``,
    ``_cut``, ``_log_aggregate`` and the model, processor, tokenizer, session and totals)."""

    def loglikelihood(self: _Host, requests) -> list[LoglikelihoodResult]:
        """lmms-eval's ``loglikelihood`` requests: ``(context, continuation, doc_to_visual,
        doc_id, task, split)`` (or ``(context, continuation)``: no image, the unconditional
        requests of ``acc_mutual_info``); per request, the continuation's summed
        log-probability after the context and its images (its negative with
        ``likelihood=nll``), and whether it is greedy."""
        from tqdm import tqdm

        items = []
        for r in requests:
            context, target, *where = r.args
            images = self._visuals(*where) if where else []
            if callable(target):  # older tasks pass doc_to_target itself
                doc_id, task, split = where[1:]
                target = target(self.task_dict[task][split][doc_id])
            prompt = self._prompt(context, len(images))
            if not prompt.strip():  # an empty context: the sequence's start, as lm-eval does
                prompt = self.tokenizer.bos_token or self.tokenizer.eos_token or prompt
            prompt, cont = continuation_tokens(self.tokenizer, prompt, str(target))
            items.append((prompt, images, cont))
        order = sorted(range(len(items)), key=lambda i: -(len(items[i][0]) + len(items[i][2])))
        size = max(1, self.batch_size_per_gpu)
        pad = self.tokenizer.pad_token_id
        pad = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        out: list[Any] = [None] * len(items)
        batches = [order[i : i + size] for i in range(0, len(order), size)]
        for batch in tqdm(batches, disable=self.rank != 0, desc="lightkv scoring"):
            inputs = self._inputs([items[i][0] for i in batch], [items[i][1] for i in batch])
            pairs, seconds = score_continuations(
                self._model, inputs, [items[i][2] for i in batch], pad, self.session
            )
            rows = _rows(self, [bool(items[i][1]) for i in batch], inputs, seconds)
            for i, (lp, greedy), row in zip(batch, pairs, rows):
                pair = (-lp if self.likelihood == "nll" else lp, greedy)
                row = dict(row, task=requests[i].task_name, rank=self.rank)
                counts = LightKVTokenCounts(input_tokens=row["prompt_tokens"], lightkv=row)
                out[i] = LoglikelihoodResult(text=pair, token_counts=counts)
                _count(self, requests[i], row)
        self._log_aggregate()
        return out

    def generate_until_multi_round(self: _Host, requests) -> list[GenerationResult]:
        """lmms-eval's multi-round requests: ``(context, generation_kwargs, doc_to_visual,
        doc_to_text, doc_id, task, split)``. Round 0 answers the context with the document's
        images; round ``r`` asks what ``doc_to_text(doc, previous_output=answers,
        round_idx=r, previous_round_info=info)`` returns (``(visuals, context, terminal,
        round_result, info)``) until it says ``terminal``. The answer: the ``round_result``
        returned with ``terminal`` (else the rounds' answers), a list."""
        from tqdm import tqdm

        out = []
        for r in tqdm(requests, disable=self.rank != 0, desc="lightkv conversing"):
            out.append(_conversation(self, r))
        self._log_aggregate()
        return out


def _conversation(host: _Host, request) -> GenerationResult:
    """One multi-round request, all its rounds inside one ``with`` of the session."""
    context, gen_kwargs, doc_to_visual, doc_to_text, doc_id, task, split = request.args
    doc = host.task_dict[task][split][doc_id]
    images = host._visuals(doc_to_visual, doc_id, task, split)
    args, until = host._generation_args(gen_kwargs)
    prompt = host._prompt(context, len(images))
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": context}]
    messages = [{"role": "user", "content": content}]
    turns, answers, n_out, info = Turns(host._model), [], 0, None
    t0 = time.perf_counter()
    with (
        host.session if host.session is not None else contextlib.nullcontext(),
        PrefillTimer(host._model) as timer,
    ):
        inputs = host._inputs([prompt], [images])
        ids = turns.ask(args, inputs=inputs)
        while True:
            reply = host.tokenizer.decode(ids[0], skip_special_tokens=True)
            answers.append(host._cut(reply, until))
            n_out += ids.shape[1]
            step = doc_to_text(
                doc, previous_output=list(answers), round_idx=len(answers),
                previous_round_info=info,
            )  # fmt: skip
            visuals, context, terminal, result, info = step
            if terminal:
                break
            if visuals and not _same_images(visuals, images):
                raise NotImplementedError(
                    f"round {len(answers)} of {task} brings new images: lightkv carries "
                    "the first round's compressed cache and does not add images to it"
                )
            messages, prompt, text = next_turn(
                host.processor, messages, prompt, reply, str(context)
            )
            ids = turns.ask(args, new_ids=new_turn_ids(host.tokenizer, text, ids[0].tolist()))
    row = _rows(host, [bool(images)], inputs, timer.seconds)[0]
    row = dict(row, task=task, rank=host.rank, rounds=len(answers), output_tokens=n_out)
    row["generate_s"] = time.perf_counter() - t0
    _count(host, request, row)
    counts = LightKVTokenCounts(input_tokens=row["prompt_tokens"], output_tokens=n_out, lightkv=row)
    final = list(result) if isinstance(result, (list, tuple)) else answers
    return GenerationResult(text=final, token_counts=counts)


def _same_images(visuals, images: list) -> bool:
    """True when a round's visuals are the first round's images again (nothing to add)."""
    visuals = list(visuals) if isinstance(visuals, (list, tuple)) else [visuals]
    if len(visuals) != len(images):
        return False
    return all(hasattr(v, "convert") and v.convert("RGB") == im for v, im in zip(visuals, images))
