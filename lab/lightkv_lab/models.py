"""The bundled models as the library finds them (entry-point group ``lightkv.models``):
``lightkv generate --model scenes|digitgrid|symbolgrid`` and lmms-eval's ``pretrained=NAME``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["BundledModel", "digitgrid", "scenes", "symbolgrid"]


@dataclass(frozen=True)
class BundledModel:
    """A model directory shipped in the laboratory, by name."""

    name: str

    @property
    def path(self) -> Path:
        """The model's Hugging Face directory (config, weights, tokenizer, processor)."""
        from .tasks.model import BUNDLED_MODELS

        return BUNDLED_MODELS[self.name]

    def example(self):
        """A held-out image (PIL) of the model's task and ``{"question": ..., "answer": ...}``."""
        from .tasks import evaluate
        from .tasks.digitgrid.images import to_pil
        from .tasks.model import read_grid_config

        ep = evaluate.heldout_episodes(1, seed=0, grid=read_grid_config(self.path))[0]
        return to_pil(ep.image), {"question": " ".join(ep.question), "answer": " ".join(ep.answer)}


scenes = BundledModel("scenes")
digitgrid = BundledModel("digitgrid")
symbolgrid = BundledModel("symbolgrid")
