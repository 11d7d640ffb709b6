"""The inputs of the recorded authors' fixtures (``fixtures/<method>.json``), regenerated from
their seeds: every fixture stores seeds, shapes and the kept indices the authors' released code
returned on these tensors, never the tensors themselves.

One prompt row: `BEFORE` text tokens (LLaVA-1.5's system prompt length), one image of ``n``
tokens (`GRIDS`), then `QUESTION` text tokens (the question). Each tensor is drawn with
``torch.randn`` from one ``torch.Generator().manual_seed(seed)``, in the order the fixture's
``draws`` lists them; a vision tower's CLS attention row is the softmax of its draw times the
case's ``scale`` (``[H, 1 + n]``, column 0 the CLS token itself).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lightkv import ImageSegment, VisionLayout
from lightkv.policies import Prompt

BEFORE = 35
QUESTION = 12
GRIDS = {576: (24, 24), 256: (16, 16)}
FIXTURES = Path(__file__).parent / "fixtures"


def fixture(method: str) -> dict:
    """The recorded fixture of ``method``."""
    return json.loads((FIXTURES / f"{method}.json").read_text())


def seq_len(n: int) -> int:
    """``S``: the prompt's length with an image of ``n`` tokens."""
    return BEFORE + n + QUESTION


def layout(n: int) -> VisionLayout:
    """The prompt's layout: the image at ``BEFORE``, its grid from `GRIDS`."""
    return VisionLayout.from_segments(
        1, seq_len(n), [ImageSegment(row=0, offset=BEFORE, grid=GRIDS[n])]
    )


def prompt(n: int) -> Prompt:
    """Token ids for the prompt (distinct; only their positions matter here)."""
    return Prompt(torch.arange(seq_len(n)).unsqueeze(0))


def draw(seed: int, n: int, draws: list[list]) -> dict[str, torch.Tensor]:
    """The tensors of one case: ``draws`` is ``[[name, [dims...]], ...]`` with ``"S"`` for the
    prompt's length and ``"n"`` / ``"1+n"`` for the image's tokens (without / with CLS)."""
    sizes = {"S": seq_len(n), "n": n, "1+n": 1 + n}
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(*[sizes.get(d, d) for d in dims], generator=g) for name, dims in draws
    }


def cls_row(logits: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``[H, 1 + n]``: a tower layer's CLS attention row per head (softmax over the CLS token
    and the ``n`` patches)."""
    return torch.softmax(scale * logits, dim=-1)


def on_image(rows: torch.Tensor, n: int) -> torch.Tensor:
    """``[1, H, S]``: per-head values of the ``n`` patches (``rows [H, n]``) at the image's
    positions of the prompt, zero elsewhere (the tower relevance's ``tower=`` input)."""
    out = rows.new_zeros(1, rows.shape[0], seq_len(n))
    out[0, :, BEFORE : BEFORE + n] = rows
    return out


def image_kept(kept_index: torch.Tensor, n: int) -> list[int]:
    """Sorted image-token indices (0-based in the image) a stage kept (``kept_index [1, W]``)."""
    idx = kept_index[0]
    idx = idx[(idx >= BEFORE) & (idx < BEFORE + n)] - BEFORE
    return sorted(idx.tolist())
