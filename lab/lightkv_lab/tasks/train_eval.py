"""Held-out evaluations the trainer logs: the align stage's label read-out and the qa
stage's greedy exact match per question type."""

from __future__ import annotations

import random

import torch

from lightkv_lab.tasks.labels import label_accuracy, label_groups, vision_words
from lightkv_lab.tasks.model import ModelSpec
from lightkv_lab.tasks.registry import task_for

__all__ = ["evaluate_align", "evaluate_qa"]


def _projected(model, pixel_values: torch.Tensor) -> torch.Tensor:
    out = model.model.get_image_features(pixel_values=pixel_values)
    return torch.stack(list(out.pooler_output))


@torch.no_grad()
def evaluate_align(
    model,
    spec: ModelSpec,
    grid,
    n: int = 256,
    seed: int = 1234,
    translate: torch.Tensor | None = None,
) -> dict:
    """Read-out accuracy of the projected tokens on held-out images: each cell's content
    (nearest content word embedding, averaged over the cell's tokens) and each token's
    position (``position_acc``: the nearest cell word is its own cell's)."""
    model.eval()
    task = task_for(grid)
    rng = random.Random(f"align-eval:{seed}")
    grids, images = task.image_batch(rng, "heldout", n, grid)
    feats = _projected(model, images)  # [B, N, D]
    if label_groups(task) is not None:
        model.train()
        return label_accuracy(model, feats, grids, label_groups(task), translate)
    ids = list(task.content_ids())
    content = vision_words(model, ids, translate)
    k = grid.cell // spec.patch
    c = len(ids)
    logits = (feats @ content.T).reshape(n, grid.grid, k, grid.grid, k, c)
    per_cell = logits.mean((2, 4)).argmax(-1)
    truth = torch.where(grids >= 0, grids, c - 1)
    occ = grids >= 0
    _, cells = task.token_words(grids[:1], k)
    names = torch.unique(cells)
    nearest = names[(feats @ vision_words(model, names, translate).T).argmax(-1)]  # [B, N] word ids
    where = nearest == cells  # the nearest cell word is the token's own
    model.train()
    return {
        "cell_acc": float((per_cell == truth).float().mean()),
        "position_acc": float(where.float().mean()),
        "occupied_acc": float((per_cell == truth)[occ].float().mean()),
        "grid_exact": float((per_cell == truth).all(-1).all(-1).float().mean()),
    }


@torch.no_grad()
def evaluate_qa(
    model, grid, n_per_type: int = 64, seed: int = 4321, batch: int = 64, split: str = "heldout"
) -> dict:
    """Greedy exact-match accuracy per question type on ``n_per_type`` held-out episodes each."""
    from lightkv_lab.tasks.evaluate import answer

    model.eval()
    data = task_for(grid).data
    result = {}
    for qtype in data.QTYPES:
        rng = random.Random(f"qa-eval:{seed}:{qtype}")
        eps = [data.make_episode(rng, split, qtype, grid) for _ in range(n_per_type)]
        got = [
            words
            for i in range(0, len(eps), batch)
            for words in answer(model, eps[i : i + batch], grid)
        ]
        result[qtype] = sum(g == ep.answer for g, ep in zip(got, eps)) / len(eps)
    model.train()
    return result
