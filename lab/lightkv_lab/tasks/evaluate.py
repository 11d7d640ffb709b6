"""Answer a task's questions with a trained model, with or without a compression pipeline.

```python
from lightkv_lab.tasks import evaluate, model as dg_model
m, _, grid = dg_model.load()
episodes = evaluate.heldout_episodes(200, grid=grid)
print(evaluate.evaluate(m, episodes, grid, pipeline=None).accuracy)
```

`evaluate` runs batched greedy generation (left padding) and, with a pipeline, reads the
session report of every batch: the kept vision fraction (averaged over layers) and the
vision KV bytes per episode. `relevance_mass` measures where the model's own relevance
goes for cell questions (see its docstring).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch

from lightkv.adapters import apply
from lightkv.presets import get_preset
from lightkv_lab.tasks.digitgrid.config import DEFAULT_CONFIG, Episode, GridConfig
from lightkv_lab.tasks.digitgrid.vocab import EOS_ID, PAD_ID, VOCAB
from lightkv_lab.tasks.registry import task_for
from lightkv_lab.tasks.towers import fit_tower

__all__ = ["EvalResult", "answer", "evaluate", "heldout_episodes", "relevance_mass"]


def heldout_episodes(
    n: int,
    seed: int = 0,
    grid: GridConfig = DEFAULT_CONFIG,
    qtypes: Sequence[str] | None = None,
    split: str = "heldout",
) -> list[Episode]:
    """``n`` held-out episodes, question types in equal shares (round-robin), seeded."""
    task = task_for(grid)
    data = task.data
    qtypes = task.asked(grid) if qtypes is None else qtypes
    rng = random.Random(f"digitgrid-eval:{seed}")
    return [data.make_episode(rng, split, qtypes[i % len(qtypes)], grid) for i in range(n)]


def _words(ids: list[int], vocab: Sequence[str] = VOCAB) -> list[str]:
    out = []
    for i in ids:
        if i in (EOS_ID, PAD_ID):
            break
        out.append(vocab[i])
    return out


@torch.no_grad()
def answer(
    model, episodes: Sequence[Episode], grid: GridConfig, max_new_tokens: int | None = None
) -> list[list[str]]:
    """Greedy answers (word lists) for one batch of episodes (of the task ``grid`` belongs to;
    by default up to two words more than its longest answer)."""
    task = task_for(grid)
    n_img = task.data.num_image_tokens(grid, model.config.vision_config.patch_size)
    inputs = task.data.collate_prompts(episodes, n_img)
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    if max_new_tokens is None:
        max_new_tokens = task.answer_length(grid) + 2
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
    )
    return [_words(row, task.vocab) for row in out[:, inputs["input_ids"].shape[1] :].tolist()]


@dataclass
class EvalResult:
    """Accuracy per question type plus what the cache held."""

    accuracy: dict[str, float]
    count: dict[str, int]
    kept_fraction: float
    """Kept vision fraction averaged over layers and episodes (1.0 uncompressed)."""
    kv_bytes_vision: float
    """Vision KV bytes per episode (as allocated, all layers)."""
    kv_bytes_vision_baseline: float
    seconds: float
    answers: list[list[str]] = field(default_factory=list, repr=False)

    @property
    def overall(self) -> float:
        n = sum(self.count.values())
        return sum(self.accuracy[q] * self.count[q] for q in self.count) / n if n else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("answers")
        d["overall"] = self.overall
        return d


def evaluate(
    model, episodes: Sequence[Episode], grid: GridConfig, pipeline=None, batch: int = 64
) -> EvalResult:
    """Accuracy of ``model`` on ``episodes``, compressing every prefill with ``pipeline``
    (None: uncompressed). KV figures come from the session report (uncompressed runs use
    the report's baseline of a no-op session, so both are measured the same way)."""
    from lightkv.pipeline import Pipeline

    pipe = pipeline if pipeline is not None else _identity_pipeline()
    if not isinstance(pipe, Pipeline):
        raise TypeError(
            f"pipeline must be a lightkv.Pipeline or None, got {type(pipeline).__name__}"
        )
    right: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    answers: list[list[str]] = []
    kept_sum = bytes_sum = base_sum = 0.0
    t0 = time.perf_counter()
    session = apply(fit_tower(pipe, model.config.vision_config.num_hidden_layers), model)
    for i in range(0, len(episodes), batch):
        chunk = list(episodes[i : i + batch])
        with session:
            got = answer(model, chunk, grid)
        rep = session.report()
        kept_sum += (
            rep.kept_vision_fraction if rep.kept_vision_fraction is not None else 1.0
        ) * len(chunk)
        bytes_sum += rep.kv_bytes_vision
        base_sum += rep.kv_bytes_vision_baseline
        for ep, words in zip(chunk, got):
            count[ep.qtype] += 1
            right[ep.qtype] += words == ep.answer
        answers += got
    n = max(1, len(episodes))
    qtypes = task_for(grid).qtypes  # reported in the task's order
    return EvalResult(
        accuracy={q: right[q] / count[q] for q in qtypes if count[q]},
        count={q: count[q] for q in qtypes if count[q]},
        kept_fraction=kept_sum / n,
        kv_bytes_vision=bytes_sum / n,
        kv_bytes_vision_baseline=base_sum / n,
        seconds=time.perf_counter() - t0,
        answers=answers,
    )


def _identity_pipeline():
    from lightkv.policies.schedulers import ExplicitSchedule

    return get_preset("lightkv").with_scheduler(
        ExplicitSchedule(layers=(), removal_ratios=(), windows_per_side=None)
    )


@torch.no_grad()
def relevance_mass(
    model,
    episodes: Sequence[Episode],
    grid: GridConfig,
    layers: Sequence[int] | None = None,
    batch: int = 32,
) -> dict:
    """Where relevance goes for ``what`` questions (about occupied cells, for DigitGrid).

    For every layer ``l`` in ``layers`` (default: all but the last) a one-stage pipeline
    after ``l`` records the relevance ξ that lightkv's policies compute from that layer's
    own projections: ``query_softmax`` (the paper's vision-query x text-key score, softmax
    over the query axis) and ``last_token`` (FastV's attention of the last prompt token).
    Reported per layer and policy, averaged over episodes: the share of the image's
    relevance mass on the asked cell, on another cell (a control picked at random; an
    occupied one for DigitGrid), and the area share of one cell (``1 / G^2``). A model that
    reads the asked region puts clearly more than the area share on it, and more than on
    the control.
    """
    from lightkv.graph.layout import TokenKind
    from lightkv.policies.relevance import Relevance
    from lightkv.policies.schedulers import ExplicitSchedule

    task = task_for(grid)
    data = task.data
    eps = [e for e in episodes if e.qtype == "what" and e.answer != ["none"]]
    if not eps:
        raise ValueError("relevance_mass needs 'what' episodes (about occupied cells)")
    num_layers = model.config.text_config.num_hidden_layers
    layers = list(range(num_layers - 1)) if layers is None else list(layers)
    patch = model.config.vision_config.patch_size
    n_img = data.num_image_tokens(grid, patch)
    _, cell_of = task.token_words(
        eps[0].grid[None], grid.cell // patch
    )  # [N] word id of each token's cell
    rng = random.Random("relevance-control")
    controls = []
    for e in eps:
        others = [
            (r, c)
            for r in range(grid.grid)
            for c in range(grid.grid)
            if e.grid[r, c] >= 0 and (r, c) != (e.meta["row"], e.meta["col"])
        ]
        controls.append(rng.choice(others) if others else None)

    def cell_id(r: int, c: int) -> int:
        return data.WORD_TO_ID[data.cell_word(r, c)]

    out: dict = {"episodes": len(eps), "area_share": 1 / grid.grid**2, "layers": {}}
    for policy in ("query_softmax", "last_token"):
        for layer in layers:
            # a stage that barely merges, only so that the session records ξ at this layer
            pipe = replace(
                get_preset("lightkv"),
                relevance=Relevance.create(policy),
                scheduler=ExplicitSchedule(
                    layers=(layer,), removal_ratios=(0.01,), windows_per_side=(1,)
                ),
            )
            asked_sum = control_sum = 0.0
            n_control = 0
            for i in range(0, len(eps), batch):
                chunk, ctrl = eps[i : i + batch], controls[i : i + batch]
                inputs = data.collate_prompts(chunk, n_img)
                with apply(pipe, model, record=True) as session:
                    model(**inputs)
                rec = session.last_prefill.stages[0]
                xi = rec.relevance.float()  # [B, L]
                vision = rec.layout.kind == int(TokenKind.VISION)
                for b, (e, cc) in enumerate(zip(chunk, ctrl)):
                    mass = xi[b][vision[b]]
                    mass = mass / mass.sum().clamp_min(1e-30)
                    asked_sum += float(mass[cell_of == cell_id(e.meta["row"], e.meta["col"])].sum())
                    if cc is not None:
                        control_sum += float(mass[cell_of == cell_id(*cc)].sum())
                        n_control += 1
            out["layers"].setdefault(str(layer), {})[policy] = {
                "asked": asked_sum / len(eps),
                "control": control_sum / max(1, n_control),
            }
    return out
