"""A tiny random Qwen2.5-VL saved as a model directory vLLM can load, built offline.

Two decoder layers of width 64 (two heads of 32: vLLM's CPU attention takes head sizes 32,
64, 80, ...), a one-block vision tower with 4-pixel patches (an image of ``8r x 8c`` pixels
is ``r x c`` tokens after the 2x2 merge), a word-level tokenizer made with `tokenizers`
(words ``w0`` .. ``w99`` and Qwen's special tokens), and the image processor's config.
"""

from __future__ import annotations

import json
from pathlib import Path

WORDS = 100
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
PATCH = 4
MERGE = 2


def vocab() -> dict[str, int]:
    """Word -> id: the words first, then the special tokens."""
    words = {f"w{i}": i for i in range(WORDS)}
    words.update({tok: WORDS + i for i, tok in enumerate(SPECIAL)})
    return words


def build(out: Path, seed: int = 0, max_positions: int = 2048) -> Path:
    """Write the model directory ``out`` (config, weights, tokenizer, processor) and return it;
    ``max_positions`` is the context length vLLM derives for it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
    )

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = vocab()
    tok = Tokenizer(models.WordLevel(vocab=ids, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
    )
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=1,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        window_size=4 * PATCH,
        out_hidden_size=64,
        fullatt_block_indexes=[0],
    )
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
    )
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # larger logits than the default init: greedy decoding far from ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(out, safe_serialization=True)
    factor = PATCH * MERGE
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": PATCH,
        "merge_size": MERGE,
        "temporal_patch_size": 2,
        "min_pixels": factor * factor,
        "max_pixels": 64 * factor * 64 * factor,
        "size": {"shortest_edge": factor * factor, "longest_edge": 64 * factor * 64 * factor},
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=1))
    return out


def prompt(words: int = 6, seed: int = 0, images: int = 1) -> str:
    """Words, then per image ``<|vision_start|> <|image_pad|> <|vision_end|>`` and more words."""
    import random

    rng = random.Random(seed)
    parts = [" ".join(f"w{rng.randrange(WORDS)}" for _ in range(words))]
    for _ in range(images):
        parts += [
            "<|vision_start|> <|image_pad|> <|vision_end|>",
            " ".join(f"w{rng.randrange(WORDS)}" for _ in range(3)),
        ]
    return " ".join(parts)


def image(rows: int, cols: int, seed: int = 0):
    """A random RGB image of ``rows x cols`` tokens (``8 rows x 8 cols`` pixels)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    factor = PATCH * MERGE
    return Image.fromarray(rng.integers(0, 256, (rows * factor, cols * factor, 3), dtype=np.uint8))


def request(p: dict) -> tuple[str, list]:
    """The prompt text and images of a test prompt ``{"images": [[rows, cols], ...], "seed": s,
    "image_seed": s2, "question": "w5 w6"}``: with ``question``, one image first, then the
    question (a prompt-dependent suffix); else `prompt`."""
    base = p.get("image_seed", p.get("seed", 0))
    images = [image(r, c, seed=base + i) for i, (r, c) in enumerate(p["images"])]
    text = prompt(seed=p.get("seed", 0), images=len(images))
    if p.get("question"):
        text = "w1 <|vision_start|> <|image_pad|> <|vision_end|> " + p["question"]
    return text, images
