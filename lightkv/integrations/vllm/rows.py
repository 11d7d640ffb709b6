"""A batch of prompts as lightkv's pre-LLM stage sees them, for the vLLM plugin: images back
to back, then the question's tokens; the survivors of each image (no vLLM needed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...graph.layout import ImageSegment, VisionLayout
from ...policies.prompt import Prompt
from ...stage import Stage

__all__ = ["MAX_IMAGE_TOKENS", "Row", "Selection", "check_grid", "run_rows"]

MAX_IMAGE_TOKENS = 16384
"""The largest image grid (rows x cols tokens) the plan sizes: Qwen2.5-VL's largest default
image (16,384 merged tokens at ``max_pixels``). DivPrune's probe holds an N x N similarity
(1 GiB in float32 at this size); a 100,000 x 100,000 grid used to allocate 640 GB."""


@dataclass(frozen=True)
class Selection:
    """The survivors of one image.

    Attributes:
        embeds: ``[k, D]`` their embeddings (a merged token holds the merge's result).
        index: ``[k]`` int64, ascending: each survivor's index in the image's row-major
            token grid (its original position).
        sizes: ``[k]`` how many of the image's tokens each survivor holds (a merged token
            more than one; weighted where the pipeline weighs its merges), what proportional
            attention counts.
    """

    embeds: torch.Tensor
    index: torch.Tensor
    sizes: torch.Tensor


def check_grid(rows: int, cols: int) -> None:
    """Refuse a grid that is not positive or larger than `MAX_IMAGE_TOKENS`, before any tensor.

    Raises:
        ValueError: naming the grid and the limit.
    """
    if rows <= 0 or cols <= 0:
        raise ValueError(f"an image grid must be positive, got {rows} x {cols}")
    if rows * cols > MAX_IMAGE_TOKENS:
        raise ValueError(
            f"an image grid has at most {MAX_IMAGE_TOKENS:,} tokens (Qwen2.5-VL's largest default "
            f"image), got {rows:,} x {cols:,} = {rows * cols:,}"
        )


Row = tuple[
    Sequence[torch.Tensor], Sequence[tuple[int, int]], "torch.Tensor | None", "torch.Tensor | None"
]
"""One prompt for `run_rows`: its images' embeddings and grids, its question's input
embeddings ``[T, D]`` (or None) and token ids ``[T]`` (or None)."""


def run_rows(stage: Stage, rows: Sequence[Row], reads_prompt: bool) -> list[list[Selection]]:
    """Run ``stage`` on a padded batch, one prompt per row: its images back to back,
    then its question's tokens (text after the last image, `Prompt.question_mask`), what
    lightkv's adapters give the stage for a whole prompt, less the text the stage does not
    read. Returns per row, per image, its `Selection`."""
    if not rows:
        return []
    width, ref = 0, None
    for i, (embeds, grids, question, _) in enumerate(rows):
        if len(embeds) != len(grids):
            raise ValueError(f"{len(embeds)} embeddings for {len(grids)} grids")
        for e, (r, c) in zip(embeds, grids):
            check_grid(int(r), int(c))
            if e.dim() != 2 or e.shape[0] != int(r) * int(c):
                raise ValueError(
                    f"image {i}: embeddings {tuple(e.shape)} do not match its {(r, c)} grid "
                    f"({int(r) * int(c)} tokens)"
                )
            ref = e if ref is None else ref
        t = 0 if question is None else int(question.shape[0])
        width = max(width, sum(int(r) * int(c) for r, c in grids) + t)
    if ref is None:
        return [[] for _ in rows]
    b = len(rows)
    hidden = ref.new_zeros(b, width, ref.shape[1])
    pad = torch.ones(b, width, dtype=torch.bool)
    token_ids = torch.zeros(b, width, dtype=torch.long)
    segments, spans = [], []
    for i, (embeds, grids, question, ids) in enumerate(rows):
        at, row_spans = 0, []
        for e, (r, c) in zip(embeds, grids):
            n = int(r) * int(c)
            hidden[i, at : at + n] = e.to(hidden.dtype)
            segments.append(ImageSegment(row=i, offset=at, grid=(int(r), int(c))))
            row_spans.append((at, n))
            at += n
        if question is not None and question.shape[0]:
            t = int(question.shape[0])
            hidden[i, at : at + t] = question.to(device=hidden.device, dtype=hidden.dtype)
            if ids is not None:
                token_ids[i, at : at + t] = ids.reshape(-1).to(torch.long).cpu()
            at += t
        pad[i, :at] = False
        spans.append(row_spans)
    layout = VisionLayout.from_segments(b, width, segments, padding_mask=pad, device=hidden.device)
    prompt = Prompt(token_ids.to(hidden.device)) if reads_prompt else None
    relevance = stage.relevance_scores(None, None, layout, prompt=prompt, hidden=hidden).float()
    out = stage(hidden, layout, relevance.to(hidden.device), None, None, prompt)
    sizes = out.sizes
    result = []
    for i, row_spans in enumerate(spans):
        row = out.kept_index[i]
        sels = []
        for at, n in row_spans:
            keep = (row >= at) & (row < at + n)
            sels.append(Selection(out.hidden[i][keep], row[keep] - at, sizes[i][keep]))
        result.append(sels)
    return result
