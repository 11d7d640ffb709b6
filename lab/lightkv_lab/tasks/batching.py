"""Batching for every task: episodes as left-padded token sequences for a LLaVA-style model.

`collate` makes one ``<bos> <image>*n <sep> question [answer <eos>]`` row per episode,
`collate_scenes` one row per image with several questions and answers, `collate_prompts`
the prompt-only rows for generation; `left_pad` pads the rows (and their ``labels``), and
`num_image_tokens` says how many ``<image>`` tokens a ViT's patch size gives. The
collators take any episodes with ``image``, ``question`` and ``answer`` and an ``encoder``
for their words, so the SymbolGrid task reuses them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lightkv_lab.tasks.digitgrid.config import DEFAULT_CONFIG, Episode, GridConfig
from lightkv_lab.tasks.digitgrid.vocab import (
    BOS_ID,
    EOS_ID,
    IGNORE_INDEX,
    IMAGE_ID,
    PAD_ID,
    SEP_ID,
    encode,
)

__all__ = ["collate", "collate_prompts", "collate_scenes", "left_pad", "num_image_tokens"]


def num_image_tokens(config: GridConfig = DEFAULT_CONFIG, patch: int = 4) -> int:
    """Vision tokens a ViT with ``patch``-pixel patches produces (``(H / patch) ** 2``)."""
    if config.image_size % patch:
        raise ValueError(f"image size {config.image_size} is not a multiple of patch {patch}")
    return (config.image_size // patch) ** 2


def collate(
    episodes: Sequence[Episode],
    num_image_tokens: int,
    *,
    with_answer: bool = True,
    encoder: Callable[[Sequence[str]], list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Batch episodes for a LLaVA-style model.

    Each row is ``<bos> <image>*num_image_tokens <sep> question`` followed, when
    ``with_answer``, by ``answer <eos>``; rows are left-padded with ``<pad>`` (mask 0).
    Returns ``input_ids`` and ``attention_mask`` ``[B, L]`` (int64), ``pixel_values``
    ``[B, 3, H, W]`` and, when ``with_answer``, ``labels`` ``[B, L]``: ``input_ids`` on the
    answer and ``<eos>`` tokens, -100 elsewhere (unshifted; the model shifts). ``encoder``
    maps words to ids (default: this vocabulary's `encode`; another task passes its own,
    with the same special-token ids).
    """
    encode_ = encoder or encode
    if not episodes:
        raise ValueError("collate needs at least one episode")
    if num_image_tokens < 0:
        raise ValueError("num_image_tokens must be >= 0")
    rows, label_rows = [], []
    for ep in episodes:
        prompt = [BOS_ID] + [IMAGE_ID] * num_image_tokens + [SEP_ID] + encode_(ep.question)
        if with_answer:
            target = encode_(ep.answer) + [EOS_ID]
            rows.append(prompt + target)
            label_rows.append([IGNORE_INDEX] * len(prompt) + target)
        else:
            rows.append(prompt)
    batch = left_pad(rows, label_rows if with_answer else None)
    batch["pixel_values"] = torch.stack([ep.image for ep in episodes])
    return batch


def left_pad(
    rows: list[list[int]], label_rows: list[list[int]] | None, pad_id: int = PAD_ID
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` (and ``labels``) ``[B, L]``, left-padded with
    ``pad_id``."""
    length = max(len(r) for r in rows)
    b = len(rows)
    out = {
        "input_ids": torch.full((b, length), pad_id, dtype=torch.int64),
        "attention_mask": torch.zeros((b, length), dtype=torch.int64),
    }
    if label_rows is not None:
        out["labels"] = torch.full((b, length), IGNORE_INDEX, dtype=torch.int64)
    for i, row in enumerate(rows):
        out["input_ids"][i, length - len(row) :] = torch.tensor(row)
        out["attention_mask"][i, length - len(row) :] = 1
        if label_rows is not None:
            out["labels"][i, length - len(row) :] = torch.tensor(label_rows[i])
    return out


def collate_scenes(
    scenes: Sequence[Sequence[Episode]],
    num_image_tokens: int,
    encoder: Callable[[Sequence[str]], list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Batch scenes (several questions about one image) as one sequence per image.

    A row is ``<bos> <image>*n <sep> q1 a1 <eos> q2 a2 <eos> ...``: its first
    question looks exactly like a `collate` row, so training on scenes teaches the
    single-question format while amortising the image tokens over several answers.
    ``encoder`` as in `collate`.
    """
    encode_ = encoder or encode
    if not scenes or any(not s for s in scenes):
        raise ValueError("collate_scenes needs at least one scene, each with at least one episode")
    rows, label_rows = [], []
    for scene in scenes:
        row = [BOS_ID] + [IMAGE_ID] * num_image_tokens + [SEP_ID]
        lab = [IGNORE_INDEX] * len(row)
        for ep in scene:
            q = encode_(ep.question)
            a = encode_(ep.answer) + [EOS_ID]
            row += q + a
            lab += [IGNORE_INDEX] * len(q) + a
        rows.append(row)
        label_rows.append(lab)
    batch = left_pad(rows, label_rows)
    batch["pixel_values"] = torch.stack([scene[0].image for scene in scenes])
    return batch


def collate_prompts(
    episodes: Sequence[Episode],
    num_image_tokens: int,
    encoder: Callable[[Sequence[str]], list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Prompt-only batch for evaluation/generation (no answer, no ``labels``).

    Rows end with the question's last word, so with left padding every row's next token is
    the first answer word; compare generations with ``episode.answer``.
    """
    return collate(episodes, num_image_tokens, with_answer=False, encoder=encoder)
