"""Loading a model, its processor and an image, and building the processor inputs of one
image + prompt."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .errors import GenerateError, _first_line
from .hub import hub_access
from .results import Loaded

__all__ = ["DTYPES", "build_inputs", "decoder_depth", "load_image", "load_model"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _looks_like_path(text: str) -> bool:
    """True unless ``text`` has the shape of a hub id (``name`` or ``org/name``)."""
    if os.path.isabs(text) or text.startswith((".", "~")) or "\\" in text:
        return True
    return text.count("/") > 1


def load_model(
    source: str, *, dtype: str = "float32", device: str | None = None, check=None
) -> Loaded:
    """Load a supported model and its processor from a local directory or a hub id.

    ``check``, when given, is a `lightkv.config.PipelineConfig` whose schedule is checked
    against the model's decoder depth before the weights are loaded.

    Raises:
        ConfigError: ``check``'s schedule does not fit the model.
        GenerateError: the directory does not exist, a hub id is neither reachable nor
            cached (at once: `lightkv.generate.hub`), the model cannot be loaded, or its
            family is not supported by lightkv.
    """
    expanded = os.path.expanduser(source)
    local = os.path.isdir(expanded)
    if local:
        source_path = expanded
    elif os.path.exists(expanded):
        raise GenerateError(f"{source}: not a model directory (expected a folder with config.json)")
    elif _looks_like_path(source):
        raise GenerateError(f"{source}: model directory not found")
    else:
        source_path = source  # a hub id (needs the network or the local cache)
    if local and not os.path.isfile(os.path.join(expanded, "config.json")):
        raise GenerateError(
            f"{source}: no config.json in this directory (not a saved transformers model)"
        )
    # a hub id the hub cannot serve fails here, at once (not after the hub client's retries)
    hub = {} if local else hub_access(source)
    from transformers import AutoConfig, AutoProcessor  # after the checks: importing takes seconds

    from ..adapters.registry import MODEL_TYPES, SUPPORTED_FAMILIES

    try:
        config = AutoConfig.from_pretrained(source_path, **hub)
    except (OSError, ValueError, KeyError) as e:
        raise GenerateError(
            f"cannot load the model config from {source!r}: {_first_line(e)}"
        ) from None
    family = MODEL_TYPES.get(getattr(config, "model_type", ""))
    if family is None:
        raise GenerateError(
            f"{source}: model type {config.model_type!r} is not supported by lightkv; supported "
            f"families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    if check is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        depth = getattr(text, "num_hidden_layers", None)
        if depth:
            check.validate_for_model(int(depth))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device cuda: CUDA is not available")
    try:
        processor = AutoProcessor.from_pretrained(source_path, **hub)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GenerateError(
            f"cannot load the processor from {source!r}: {_first_line(e)}"
        ) from None
    model = _load_weights(source, source_path, config, DTYPES[dtype], hub)
    model = model.to(dev).eval()
    return Loaded(model=model, processor=processor, family=family, source=source, device=dev)


def _load_weights(source: str, path: str, config, dtype: torch.dtype, hub: dict[str, Any]):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    errors = []
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
        try:
            return auto.from_pretrained(
                path, config=config, dtype=dtype, attn_implementation="sdpa", **hub
            )
        except ValueError as e:  # config not in this auto class's mapping
            if "Unrecognized configuration class" in str(e):
                errors.append(e)
                continue
            raise GenerateError(
                f"cannot load the model from {source!r}: {_first_line(e)}"
            ) from None
        except (OSError, RuntimeError, KeyError) as e:
            raise GenerateError(
                f"cannot load the model from {source!r}: {_first_line(e)}"
            ) from None
    raise GenerateError(f"cannot load the model from {source!r}: {_first_line(errors[-1])}")


def decoder_depth(source: str) -> int | None:
    """The decoder depth of a model directory or hub id from its config alone (None where
    the config does not say or cannot be read: `load_model` then reports why)."""
    path = os.path.expanduser(source)
    try:
        hub = {} if os.path.isdir(path) or _looks_like_path(source) else hub_access(source)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, **hub)
    except (OSError, ValueError, KeyError, GenerateError):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    depth = getattr(text, "num_hidden_layers", None)
    return int(depth) if depth else None


def load_image(path: str | os.PathLike):
    """An RGB PIL image. Raises `GenerateError` for a missing or unreadable file."""
    from PIL import Image, UnidentifiedImageError

    if not str(path).strip():
        raise GenerateError("--image is empty; give an image file")
    p = Path(path).expanduser()
    if not p.exists():
        raise GenerateError(f"{path}: image file not found")
    if not p.is_file():
        raise GenerateError(f"{path}: not a file")
    try:
        with Image.open(p) as img:
            return img.convert("RGB")
    except Image.DecompressionBombError:  # Pillow's guard against images of hundreds of megapixels
        limit = (Image.MAX_IMAGE_PIXELS or 0) * 2  # set: the guard only raises under a limit
        raise GenerateError(
            f"{path}: the image is too large to decode safely (over {limit:,} "
            "pixels); resize it first"
        ) from None
    except (UnidentifiedImageError, OSError) as e:
        raise GenerateError(f"{path}: cannot read the image ({_first_line(e)})") from None


def build_inputs(loaded: Loaded, image, prompt: str) -> dict[str, Any]:
    """Processor inputs for one image (a path or a PIL image) and one prompt, on the
    model's device.

    With a chat template the prompt is one user turn (image, then text) plus the generation
    prompt; without one it is ``USER: <image>\\n{prompt} ASSISTANT:`` (unless the prompt
    already contains the image token).
    """
    proc = loaded.processor
    img = load_image(image) if isinstance(image, (str, os.PathLike)) else image
    image_token = getattr(proc, "image_token", None)
    if getattr(proc, "chat_template", None):
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}
        ]
        try:
            text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - a template error is the checkpoint's, not a crash of ours
            raise GenerateError(f"the processor's chat template failed: {_first_line(e)}") from None
    elif image_token and image_token not in prompt:
        text = f"USER: {image_token}\n{prompt} ASSISTANT:"
    else:
        text = prompt
    try:
        inputs = proc(images=img, text=text, return_tensors="pt")
    except (ValueError, TypeError, KeyError) as e:
        raise GenerateError(f"the processor could not build the inputs: {_first_line(e)}") from None
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.to(loaded.device)
            if v.is_floating_point():
                v = v.to(loaded.model.dtype)
        out[k] = v
    return out
