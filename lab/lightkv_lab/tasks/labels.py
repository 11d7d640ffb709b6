"""The align stage's losses and read-outs for tasks whose tokens carry several labels, and
the word embeddings as vision tokens carry them.

A task's data module may define ``LABEL_GROUPS`` (the word ids each of a token's labels
takes; Scenes has four: what a token shows, its kind, its vertical and horizontal half):
its ``align`` target is then ``E[<image>]`` plus the sum of the label words' embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightkv_lab.tasks.digitgrid.vocab import IMAGE_ID
from lightkv_lab.tasks.registry import Task

__all__ = ["label_accuracy", "label_groups", "label_loss", "translation", "vision_words"]


def label_groups(task: Task):
    """The task's per-token label groups (word ids per label), or None for single-content tasks."""
    return getattr(task.data, "LABEL_GROUPS", None)


def _label_logits(model, feats: torch.Tensor, group, translate) -> torch.Tensor:
    emb = vision_words(model, list(group), translate)
    return feats @ emb.T / emb.shape[1] ** 0.5


def label_loss(
    model, feats: torch.Tensor, labels: torch.Tensor, groups, translate=None
) -> torch.Tensor:
    """Align loss of a task with several labels per token (``labels [B, G, G, S]`` word ids,
    ``groups``: the word ids each label takes): the squared error to ``E[<image>] + sum of
    E[label]`` plus a cross-entropy per label over its group's words."""
    words = labels.flatten(1, 2)  # [B, N, S]
    emb = model.get_input_embeddings().weight.detach()
    target = emb[words].sum(2)
    if translate is not None:
        target = target @ translate.T
    loss = F.mse_loss(feats, target + emb[IMAGE_ID])
    for s, group in enumerate(groups):
        index = torch.full((max(group) + 1,), -1, dtype=torch.long)  # word id -> class in the group
        index[list(group)] = torch.arange(len(group))
        truth = index[words[..., s]]
        loss = loss + F.cross_entropy(
            _label_logits(model, feats, group, translate).flatten(0, 1), truth.flatten()
        )
    return loss


def label_accuracy(model, feats, labels, groups, translate=None) -> dict:
    """Held-out read-out accuracy of each label (nearest word of its group), per token."""
    words = labels.flatten(1, 2)
    out = {}
    for s, group in enumerate(groups):
        pred = torch.tensor(group)[_label_logits(model, feats, group, translate).argmax(-1)]
        out[f"label{s}_acc"] = float((pred == words[..., s]).float().mean())
    return out


def translation(width: int, seed: int) -> torch.Tensor:
    """The seeded orthogonal ``[D, D]`` matrix ``M`` of ``--translate``."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    q, r = torch.linalg.qr(torch.randn(width, width, generator=gen))
    return q * torch.sign(torch.diagonal(r))


def vision_words(model, ids, translate: torch.Tensor | None) -> torch.Tensor:
    """``[len(ids), D]``: word embeddings as vision tokens carry them (``M E`` with
    ``--translate``)."""
    emb = model.get_input_embeddings().weight.detach()[ids]
    return emb if translate is None else emb @ translate.T
