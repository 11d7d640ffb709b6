"""Teacher-forced fidelity scoring of compressed caches: accuracy, KL and log-probability.

A `Conversation` is one image with a first question and, optionally, a follow-up question
about another region. `score` runs each batch the way a chat model meets it: the prompt
(image + first question) is prefilled *inside* the compression session, so the cache is
compressed with the first question's relevance; then the reference answer, ``<eos>``, the
follow-up question and its reference answer are fed as one decoding chunk that reads the
compressed cache. Every answer token's distribution comes out of that one pass.

Greedy decoding reproduces the reference answer exactly when, at every answer position,
the reference token is the argmax given the reference prefix (the greedy path and the
forced path coincide until the first miss, and a miss changes the answer). So exact match
of the generated answer is read off the forced pass, with no separate generation;
`lightkv_lab.tasks.evaluate.evaluate` (real ``generate``) agrees with it (tested).

Per episode and turn: ``correct`` (exact match of the whole answer, ``<eos>`` included),
``logp`` (summed log-probability of the reference answer) and the per-token log-probability
vectors, from which `kl` gives KL(p_uncompressed || p_compressed) averaged over the answer's
tokens. `paired_bootstrap` gives 95% intervals of differences between methods on the same
episodes (the benchmark feeds every method the same episodes in the same batches).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lightkv.adapters import apply
from lightkv_lab.tasks.digitgrid.vocab import EOS_ID, PAD_ID
from lightkv_lab.tasks.registry import task_for
from lightkv_lab.tasks.towers import fit_tower

__all__ = ["Conversation", "ScoreResult", "conversations", "kl", "paired_bootstrap", "score"]


@dataclass
class Conversation:
    """An image, a first question and an optional follow-up question about the same image."""

    first: object
    """An ``Episode`` of the task (its image is the conversation's image)."""
    followup: object | None = None
    """An ``Episode`` about the same image, asked after the first answer."""


def conversations(
    n: int, grid, seed: int = 0, followup: bool = True, split: str = "heldout"
) -> list[Conversation]:
    """``n`` held-out conversations: first-question types in equal shares (round-robin), each
    followed (``followup``) by a question about another region: the task's own ``followup``
    where its data module has one (Scenes: another object's texture), else a ``what``
    question about a cell at least a quarter of the grid away from what the first asked (any
    cell for whole-image first questions)."""
    task = task_for(grid)
    data = task.data
    rng = random.Random(f"{task.name}-conversations:{seed}:{split}")
    asked = task.asked(grid)
    out = []
    for i in range(n):
        ep = data.make_episode(rng, split, asked[i % len(asked)], grid)
        out.append(Conversation(ep, _followup(rng, ep, grid, data) if followup else None))
    return out


def _followup(rng: random.Random, ep, grid, data):
    if hasattr(data, "followup"):  # a task with its own follow-up question
        return data.followup(rng, ep, grid)
    g = grid.grid
    far = max(1, g // 4)
    r0, c0 = ep.meta.get("row"), ep.meta.get("col")
    cells = [
        (r, c)
        for r in range(g)
        for c in range(g)
        if r0 is None or max(abs(r - r0), abs(c - c0)) >= far
    ]
    r, c = rng.choice(cells)
    meta = {"row": r, "col": c}
    kwargs = {"rare": ep.rare} if hasattr(ep, "rare") else {"digit_index": ep.digit_index}
    return type(ep)(
        image=ep.image,
        grid=ep.grid,
        question=["what", "is", "at", data.cell_word(r, c)],
        answer=data.answer_for(ep.grid, "what", meta),
        qtype="what",
        split=ep.split,
        meta=meta,
        **kwargs,
    )


@dataclass
class ScoreResult:
    """Per-episode scores of one method on a list of conversations (same order)."""

    qtypes: list[str]
    correct: torch.Tensor
    """bool ``[n]``: first answer exactly right."""
    logp: torch.Tensor
    """float64 ``[n]``: log-probability of the first reference answer (``<eos>`` included)."""
    logprobs: list[torch.Tensor] = field(repr=False)
    """Per episode, float64 ``[T, V]`` log-distributions at the first answer's positions."""
    followup_correct: torch.Tensor | None = None
    followup_logp: torch.Tensor | None = None
    followup_logprobs: list[torch.Tensor] | None = field(default=None, repr=False)
    kept_fraction: float = 1.0
    kv_bytes_vision: float = 0.0
    kv_bytes_vision_baseline: float = 0.0

    def accuracy(self) -> dict[str, float]:
        """Exact-match accuracy per question type (first turn) and ``"followup"``."""
        out = {}
        for q in dict.fromkeys(self.qtypes):
            sel = torch.tensor([t == q for t in self.qtypes])
            out[q] = float(self.correct[sel].float().mean())
        if self.followup_correct is not None:
            out["followup"] = float(self.followup_correct.float().mean())
        return out


def _ids(task, words) -> list[int]:
    return task.data.encode(words)


@torch.no_grad()
def score(
    model, convs: Sequence[Conversation], grid, pipeline=None, batch: int = 64
) -> ScoreResult:
    """Teacher-forced scores of ``model`` compressed by ``pipeline`` (None: uncompressed,
    through a session that removes nothing, so both are measured the same way)."""
    from lightkv_lab.tasks.evaluate import _identity_pipeline

    task = task_for(grid)
    data = task.data
    n_img = data.num_image_tokens(grid, model.config.vision_config.patch_size)
    pipe = pipeline if pipeline is not None else _identity_pipeline()
    pipe = fit_tower(pipe, model.config.vision_config.num_hidden_layers)
    with_followup = all(c.followup is not None for c in convs)
    if not with_followup and any(c.followup is not None for c in convs):
        raise ValueError("score needs follow-up questions on all conversations or on none")
    correct, logp, logprobs = [], [], []
    f_correct, f_logp, f_logprobs = [], [], []
    kept_sum = bytes_sum = base_sum = 0.0
    session = apply(pipe, model)
    for i in range(0, len(convs), batch):
        chunk = list(convs[i : i + batch])
        prompt = data.collate_prompts([c.first for c in chunk], n_img)
        pmask = prompt["attention_mask"]
        # continuation: answer <eos> [follow-up question, answer <eos>], right-padded
        spans, rows = [], []
        for c in chunk:
            a1 = _ids(task, c.first.answer) + [EOS_ID]
            row, span = list(a1), [(0, len(a1))]
            if with_followup:
                q2 = _ids(task, c.followup.question)
                a2 = _ids(task, c.followup.answer) + [EOS_ID]
                span.append((len(row) + len(q2), len(a2)))
                row += q2 + a2
            rows.append(row)
            spans.append(span)
        t = max(len(r) for r in rows)
        cont = torch.full((len(rows), t), PAD_ID, dtype=torch.int64)
        cmask = torch.zeros((len(rows), t), dtype=torch.int64)
        for b, r in enumerate(rows):
            cont[b, : len(r)] = torch.tensor(r)
            cmask[b, : len(r)] = 1
        ppos = (pmask.cumsum(-1) - 1).clamp_min(0)
        cpos = pmask.sum(-1, keepdim=True) + (cmask.cumsum(-1) - 1).clamp_min(0)
        with session:
            out = model(
                input_ids=prompt["input_ids"],
                attention_mask=pmask,
                position_ids=ppos,
                pixel_values=prompt["pixel_values"].to(model.dtype),
                use_cache=True,
            )
            nxt = model(
                input_ids=cont,
                attention_mask=torch.cat([pmask, cmask], 1),
                position_ids=cpos,
                cache=_cache(out),
                use_cache=True,
            )
        rep = session.report()
        kept_sum += (
            rep.kept_vision_fraction if rep.kept_vision_fraction is not None else 1.0
        ) * len(chunk)
        bytes_sum += rep.kv_bytes_vision
        base_sum += rep.kv_bytes_vision_baseline
        # logits predicting cont[j]: the prompt's last position for j = 0, else cont position j - 1
        logits = torch.cat([out.logits[:, -1:], nxt.logits[:, :-1]], 1).double().log_softmax(-1)
        for b, span in enumerate(spans):
            for turn, (start, length) in enumerate(span):
                lp = logits[b, start : start + length]
                target = cont[b, start : start + length]
                ok = bool((lp.argmax(-1) == target).all())
                total = float(lp.gather(-1, target[:, None]).sum())
                (correct if turn == 0 else f_correct).append(ok)
                (logp if turn == 0 else f_logp).append(total)
                (logprobs if turn == 0 else f_logprobs).append(lp.clone())
    n = max(1, len(convs))
    return ScoreResult(
        qtypes=[c.first.qtype for c in convs],
        correct=torch.tensor(correct, dtype=torch.bool),
        logp=torch.tensor(logp, dtype=torch.float64),
        logprobs=logprobs,
        followup_correct=torch.tensor(f_correct, dtype=torch.bool) if with_followup else None,
        followup_logp=torch.tensor(f_logp, dtype=torch.float64) if with_followup else None,
        followup_logprobs=f_logprobs if with_followup else None,
        kept_fraction=kept_sum / n,
        kv_bytes_vision=bytes_sum / n,
        kv_bytes_vision_baseline=base_sum / n,
    )


def _cache(out):
    # transformers 5 names the returned cache `cache` (`past_key_values` is deprecated)
    c = getattr(out, "cache", None)
    return c if c is not None else out.past_key_values


def kl(reference: ScoreResult, other: ScoreResult, followup: bool = False) -> torch.Tensor:
    """float64 ``[n]``: per episode, KL(p_reference || p_other) averaged over the answer's
    tokens (nats). Exactly 0 where the two distributions are equal."""
    ref = reference.followup_logprobs if followup else reference.logprobs
    oth = other.followup_logprobs if followup else other.logprobs
    if ref is None or oth is None or len(ref) != len(oth):
        raise ValueError(
            "kl needs two scores of the same conversations (with follow-ups when followup=True)"
        )
    out = []
    for p, q in zip(ref, oth):
        # >= 0 in exact arithmetic; clamp the last-digit rounding of near-equal distributions
        out.append(float((p.exp() * (p - q)).sum(-1).clamp_min(0).mean()))
    return torch.tensor(out, dtype=torch.float64)


def paired_bootstrap(
    x: torch.Tensor, y: torch.Tensor, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """``(mean(x - y), low, high)``: the paired difference of two per-episode metrics on the
    same episodes, with a 95% percentile-bootstrap interval (episodes resampled together)."""
    if x.shape != y.shape or x.dim() != 1 or x.numel() == 0:
        raise ValueError(
            f"paired_bootstrap needs two 1-D tensors of one length, got {tuple(x.shape)}, "
            f"{tuple(y.shape)}"
        )
    d = x.double() - y.double()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, d.numel(), (n_boot, d.numel()), generator=gen)
    means = d[idx].mean(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(d.mean()), lo, hi
