"""The tasks one model builder, trainer and evaluator serve: Scenes, DigitGrid, SymbolGrid
and Photos (real photographs, a pretrained tower: `lightkv_lab.tasks.photos`).

A `Task` bundles what those need from a task's data module: its vocabulary, its
`GridConfig`, episodes, scenes, collation, and the per-token words of the alignment target
(``E[<image>] + E[content] + E[cell word]``, see `lightkv_lab.tasks.model.alignment_targets`).
`get_task` looks one up by name; a saved model directory records its task's name.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import Any

import torch

__all__ = ["TASKS", "Task", "get_task", "task_for"]


@dataclass(frozen=True)
class Task:
    """One synthetic task, by the name of its data module."""

    name: str
    module: str
    answer_length: Callable[[Any], int]
    """The longest answer in words (without ``<eos>``) under a `GridConfig`."""
    loader: str | None = None
    """A module whose ``load(path, dtype)`` reads this task's saved models, where the generic
    `lightkv_lab.tasks.model.load` cannot (Photos: the tower comes from a package)."""

    @cached_property
    def data(self) -> ModuleType:
        import importlib

        return importlib.import_module(self.module)

    @property
    def vocab(self) -> tuple[str, ...]:
        return self.data.VOCAB

    @property
    def qtypes(self) -> tuple[str, ...]:
        return self.data.QTYPES

    def asked(self, config) -> tuple[str, ...]:
        """The question types evaluation asks under ``config`` (its ``asked`` field where it
        has one, else every type)."""
        return tuple(getattr(config, "asked", None) or self.data.QTYPES)

    @property
    def grid_config(self) -> type:
        return self.data.GridConfig

    def content_ids(self) -> tuple[int, ...]:
        """Word ids of what a token can show (the content read-out classes, in order)."""
        return self.data.CONTENT_IDS

    def image_batch(
        self, rng: random.Random, split: str, n: int, config
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grids [B, G, G], images [B, 3, H, W])`` of ``n`` fresh images."""
        grids, images = zip(*(self.data.sample_image(rng, split, config) for _ in range(n)))
        return torch.stack(grids), torch.stack(images)

    def token_words(self, grids: torch.Tensor, k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``(content [B, N], cell [N])``: per vision token (raster order, ``k x k`` tokens per
        cell of ``grids [B, G, G]``), the content class (index into `content_ids`; empty
        cells are the last class) and the word id naming its cell."""
        b, g, _ = grids.shape
        classes = torch.where(grids >= 0, grids, len(self.content_ids()) - 1)
        names = torch.tensor(
            [[self.data.WORD_TO_ID[self.data.cell_word(r, c)] for c in range(g)] for r in range(g)]
        )
        content = classes.repeat_interleave(k, 1).repeat_interleave(k, 2).reshape(b, -1)
        cells = names.repeat_interleave(k, 0).repeat_interleave(k, 1).reshape(-1)
        return content, cells


TASKS: dict[str, Task] = {
    "digitgrid": Task("digitgrid", "lightkv_lab.tasks.digitgrid.data", lambda config: 1),
    "symbolgrid": Task(
        "symbolgrid", "lightkv_lab.tasks.symbolgrid.data", lambda config: 2 * config.read_len - 1
    ),
    "scenes": Task("scenes", "lightkv_lab.tasks.scenes.data", lambda config: 5),
    "photos": Task(
        "photos",
        "lightkv_lab.tasks.photos.data",
        lambda config: 3,
        "lightkv_lab.tasks.photos.model",
    ),
}


def get_task(name: str) -> Task:
    """The `Task` called ``name``; a clear error lists the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None


def task_for(config) -> Task:
    """The `Task` whose `GridConfig` ``config`` is."""
    for task in TASKS.values():
        if isinstance(config, task.grid_config):
            return task
    raise TypeError(
        f"{type(config).__name__} is not the GridConfig of a known task ({', '.join(TASKS)})"
    )
