"""What every tiny model family shares: token ids, `Row`, `TinyModel`, padding, the text config.

A family module (`lightkv.testing.llava` here; every other family's in the laboratory,
``lightkv_lab.tiny.gemma3``, ...) builds on these, and ``lightkv_lab.tiny.TINY_MODELS``
registers it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["IMAGE", "NEWLINE", "PAD", "VIDEO", "VOCAB", "Row", "TinyModel", "left_pad", "text_ids"]

PAD = 0
VOCAB = 128
TEXT_LOW, TEXT_HIGH = 3, 90  # ordinary text token ids
IMAGE = 100  # image placeholder id
VIDEO = 101  # video placeholder id (Qwen2.5-VL)
VISION_START, VISION_END = 102, 103  # Qwen2.5-VL frame markers
NEWLINE = 104  # Fuyu row newline
IMG_START, IMG_END = 105, 106  # InternVL image markers


@dataclass
class Row:
    """One prompt: ``input_ids`` ``[L]`` and the row's image inputs by name."""

    input_ids: torch.Tensor
    images: dict[str, Any] = field(default_factory=dict)
    mm_token_type_ids: torch.Tensor | None = None


def text_ids(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random ordinary text token ids."""
    return torch.randint(TEXT_LOW, TEXT_HIGH, (n,), generator=gen)


def left_pad(seqs: Sequence[torch.Tensor], value: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D sequences: ``(ids [B, L], attention_mask [B, L])``."""
    width = max(int(s.shape[0]) for s in seqs)
    ids = torch.full((len(seqs), width), value, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - s.shape[0] :] = s
        mask[i, width - s.shape[0] :] = 1
    return ids, mask


def _text_config(**over) -> dict:
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    cfg.update(over)
    return cfg


def _clip_llama_configs(
    image_size: int,
    patch_size: int,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
):
    """The tiny CLIP vision tower and Llama decoder configs the LLaVA families share."""
    from transformers import CLIPVisionConfig, LlamaConfig

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=32,
    )
    text = LlamaConfig(
        **_text_config(
            num_hidden_layers=num_layers,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
        )
    )
    return vision, text


def _finish(model, dtype: torch.dtype):
    model = model.eval()
    return model.to(dtype) if dtype != torch.float32 else model


def _batch_ids(rows: Sequence[Row]) -> dict[str, torch.Tensor]:
    ids, mask = left_pad([r.input_ids for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


def _seq(*parts: torch.Tensor | Sequence[int]) -> torch.Tensor:
    return torch.cat(
        [
            p if isinstance(p, torch.Tensor) else torch.tensor(list(p), dtype=torch.long)
            for p in parts
        ]
    )


@dataclass(frozen=True)
class TinyModel:
    """Builders of one family."""

    name: str
    build: Callable[..., Any]
    row: Callable[..., Row]
    collate: Callable[[Sequence[Row]], dict]
    examples: Callable[[Any], list[Row]]
    adapter_options: dict = field(default_factory=dict)
    beam_search: str | None = None
    """Why beam search with images cannot run on this family's model (None: it can)."""


def stack_tiles(pix: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[n, max tiles, ...]``: each image's ``[tiles, ...]`` tiles, zero-padded to the most
    tiles."""
    stacked = torch.zeros(len(pix), max(p.shape[0] for p in pix), *pix[0].shape[1:])
    for i, p in enumerate(pix):
        stacked[i, : p.shape[0]] = p
    return stacked


def collate_tiles_and_videos(rows: Sequence[Row], family: str) -> dict:
    """Left-padded batch for anyres families with videos (LLaVA-OneVision, LLaVA-NeXT-Video):
    images padded to the most tiles with their ``image_sizes``, videos stacked (the model
    takes one 5-D tensor, so every video of a batch must have the same number of frames)."""
    out = _batch_ids(rows)
    pix = [p for r in rows for p in r.images.get("pixel_values", [])]
    if pix:
        out["pixel_values"] = stack_tiles(pix)
        out["image_sizes"] = torch.cat(
            [r.images["image_sizes"] for r in rows if "image_sizes" in r.images]
        )
    clips = [c for r in rows for c in r.images.get("pixel_values_videos", [])]
    if clips:
        if len({c.shape[0] for c in clips}) > 1:
            raise ValueError(
                f"the videos of one {family} batch must have the same number of frames"
            )
        out["pixel_values_videos"] = torch.stack(clips)
    return out
