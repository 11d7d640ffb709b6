"""Generate an answer to one image + prompt with a compressed prefill (``lightkv generate``).

```python
from lightkv.generate import load_model, build_inputs, run
loaded = load_model("path/to/llava-1.5-7b-hf", dtype="bfloat16", device="cuda")
inputs = build_inputs(loaded, "cat.png", "What is in the image?")
result = run(loaded, inputs, lightkv.load("lightkv"), compare=True)
print(result.format())
```

The model and its processor are loaded with transformers' auto classes
(``AutoProcessor`` and ``AutoModelForImageTextToText``, falling back to
``AutoModelForCausalLM`` for families such as Fuyu). Generation is greedy. Times are
wall-clock and come from the same ``generate`` calls: *time to first token* is when the
call hands its first new token to a streamer (vision encoder + prefill + one token),
*generate time* the whole call; each is the median over ``repeats`` calls, after one
untimed warm-up prefill. (Timing them in separate calls once showed 744 ms of generation
below 2,804 ms of TTFT on a loaded machine.)

User errors (a missing file or model, an unsupported family, a processor that cannot build
the prompt) raise `GenerateError` with a one-line message.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "GenerateError",
    "GenerateResult",
    "Loaded",
    "MAX_REPEATS",
    "Run",
    "build_inputs",
    "decoder_depth",
    "load_image",
    "load_model",
    "run",
]

MAX_REPEATS = 20
"""The most timed generate calls per variant (each is a whole generation)."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class GenerateError(Exception):
    """A problem with what the user asked for (one-line message)."""


@dataclass
class Loaded:
    """A model with its processor."""

    model: Any
    processor: Any
    family: str
    source: str
    device: torch.device


@dataclass
class Run:
    """Greedy generation: the answer and its times (seconds), each the median over
    ``repeats`` generate calls that timed both (the first token and the whole call)."""

    answer: str
    new_tokens: int
    ttft_s: float
    total_s: float
    repeats: int = 1


@dataclass
class GenerateResult:
    """What ``run`` returns: the compressed run, its report and optionally the baseline."""

    loaded: Loaded
    pipeline: str
    prompt_tokens: int
    compressed: Run
    report: Any
    baseline: Run | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary."""
        rep = self.report
        return {
            "model": self.loaded.source,
            "family": self.loaded.family,
            "pipeline": self.pipeline,
            "prompt_tokens": self.prompt_tokens,
            "compressed": asdict(self.compressed),
            "baseline": asdict(self.baseline) if self.baseline is not None else None,
            "kept_vision_fraction": rep.kept_vision_fraction,
            "target_kept_fraction": rep.target_kept_fraction,
            "missed_target": rep.missed_target,
            "kv_bytes_vision": rep.kv_bytes_vision,
            "kv_bytes_vision_baseline": rep.kv_bytes_vision_baseline,
            "kv_bytes": rep.kv_bytes,
            "kv_bytes_baseline": rep.kv_bytes_baseline,
            "stages": [asdict(s) for s in rep.stages],
            "notes": list(self.notes),
        }

    def format(self) -> str:
        """A short human-readable summary (answers, then the report)."""
        rep = self.report
        m = self.loaded
        lines = [
            f"model: {m.source} ({m.family}, {type(m.model).__name__}, {_dtype_name(m.model.dtype)}, {m.device})",
            f"pipeline: {self.pipeline}; prompt: {self.prompt_tokens} tokens",
        ]
        lines += [
            f"note: {n}" for n in self.notes
        ]  # before the answers: e.g. that they mean nothing here
        lines += [f"answer (lightkv): {self.compressed.answer!r}"]
        if self.baseline is not None:
            lines.append(f"answer (baseline): {self.baseline.answer!r}")
            same = "yes" if self.baseline.answer == self.compressed.answer else "no"
            lines.append(f"answers identical: {same}")
        kept = "n/a" if rep.kept_vision_fraction is None else f"{rep.kept_vision_fraction:.3f}"
        lines += [
            "report:",
            f"  kept vision fraction (avg over layers): {kept}"
            + (
                ""
                if rep.target_kept_fraction is None
                else f" (target {rep.target_kept_fraction:.3f})"
            ),
            (
                f"  vision KV bytes: {rep.kv_bytes_vision:,} with lightkv / {rep.kv_bytes_vision_baseline:,} without "
                f"({_ratio(rep.kv_bytes_vision, rep.kv_bytes_vision_baseline)})"
            ),
            (
                f"  total KV bytes: {rep.kv_bytes:,} with lightkv / {rep.kv_bytes_baseline:,} without "
                f"({_ratio(rep.kv_bytes, rep.kv_bytes_baseline)})"
            ),
        ]
        for s in rep.stages:
            lines.append(
                f"  stage after layer {s.layer}: vision tokens {s.vision_in} -> {s.vision_out}"
            )
        c, b = self.compressed, self.baseline
        lines.append(
            f"  time to first token: {_ms(c.ttft_s)} with lightkv"
            + (f" / {_ms(b.ttft_s)} without" if b else "")
        )
        lines.append(
            f"  generate time: {_ms(c.total_s)} with lightkv ({c.new_tokens} new tokens)"
            + (f" / {_ms(b.total_s)} without ({b.new_tokens} new tokens)" if b else "")
        )
        lines.append(
            f"  (times: median of {c.repeats} generate call(s) each; the first token and the whole call "
            "are timed in the same calls)"
        )
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------------------- loading
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
        GenerateError: the directory does not exist, the model cannot be loaded, or its
            family is not supported by lightkv.
    """
    from transformers import AutoConfig, AutoProcessor

    from .adapters.registry import MODEL_TYPES, SUPPORTED_FAMILIES

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
    try:
        config = AutoConfig.from_pretrained(source_path)
    except (OSError, ValueError, KeyError) as e:
        raise GenerateError(
            f"cannot load the model config from {source!r}: {_first_line(e)}"
        ) from None
    family = MODEL_TYPES.get(getattr(config, "model_type", None))
    if family is None:
        raise GenerateError(
            f"{source}: model type {config.model_type!r} is not supported by lightkv; supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)}"
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
        processor = AutoProcessor.from_pretrained(source_path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GenerateError(
            f"cannot load the processor from {source!r}: {_first_line(e)}"
        ) from None
    model = _load_weights(source, source_path, config, DTYPES[dtype])
    model = model.to(dev).eval()
    return Loaded(model=model, processor=processor, family=family, source=source, device=dev)


def _load_weights(source: str, path: str, config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    errors = []
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
        try:
            return auto.from_pretrained(
                path, config=config, dtype=dtype, attn_implementation="sdpa"
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
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(source))
    except (OSError, ValueError, KeyError):
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
        raise GenerateError(
            f"{path}: the image is too large to decode safely (over {Image.MAX_IMAGE_PIXELS * 2:,} pixels); "
            "resize it first"
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


# ---------------------------------------------------------------------------- running
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _FirstTokenClock:
    """A generate streamer that notes when the first new token reaches the host.

    ``generate`` hands the prompt to ``put`` first, then each step's tokens (after moving
    them to the CPU, which waits for the device), so the second ``put`` is the first token.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _generate(
    loaded: Loaded, inputs: dict[str, Any], max_new_tokens: int
) -> tuple[torch.Tensor, float, float]:
    """One greedy generate call: ``(output ids, seconds to the first new token, seconds in all)``."""
    model = loaded.model
    pad = getattr(loaded.processor, "tokenizer", None)
    pad_id = getattr(pad, "pad_token_id", None) if pad is not None else None
    extra = {"pad_token_id": pad_id} if pad_id is not None else {}
    clock = _FirstTokenClock()
    _sync(loaded.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            streamer=clock,
            **extra,
        )
    _sync(loaded.device)
    end = time.perf_counter()
    return out, (clock.first or end) - t0, end - t0


def _one(loaded: Loaded, inputs: dict[str, Any], max_new_tokens: int, repeats: int = 1) -> Run:
    """``repeats`` greedy generations; the answer of the first (greedy: all are equal) and
    the medians of their times, both timed in each call."""
    calls = [_generate(loaded, inputs, max_new_tokens) for _ in range(repeats)]
    out = calls[0][0]
    new = out[0, inputs["input_ids"].shape[1] :]
    answer = loaded.processor.decode(new, skip_special_tokens=True).strip()
    return Run(
        answer=answer,
        new_tokens=int(new.shape[0]),
        ttft_s=statistics.median(c[1] for c in calls),
        total_s=statistics.median(c[2] for c in calls),
        repeats=repeats,
    )


def run(
    loaded: Loaded,
    inputs: dict[str, Any],
    pipeline,
    *,
    compare: bool = False,
    max_new_tokens: int = 32,
    warmup: bool = True,
    repeats: int = 3,
) -> GenerateResult:
    """Greedy generation with ``pipeline`` compressing the prefill (and without, with
    ``compare``); times are medians over ``repeats`` generate calls per variant.

    Raises:
        GenerateError: the pipeline does not fit the model (e.g. a schedule deeper than
            the decoder), or the model family cannot be compressed.
    """
    from .adapters import apply
    from .config import ConfigError

    try:  # fail before generating anything
        session = apply(pipeline, loaded.model)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise GenerateError(f"cannot compress this model: {_first_line(e)}") from None
    if not 1 <= int(repeats) <= MAX_REPEATS:
        raise GenerateError(
            f"repeats must be in [1, {MAX_REPEATS}] (each is a whole generation), got {repeats!r}"
        )
    if warmup:  # first calls pay one-off costs (allocations, kernels); keep them out of the timings
        _generate(loaded, inputs, 1)
    baseline = _one(loaded, inputs, max_new_tokens, repeats) if compare else None
    with session:
        compressed = _one(loaded, inputs, max_new_tokens, repeats)
    report = session.report()
    return GenerateResult(
        loaded=loaded,
        pipeline=getattr(pipeline, "name", "custom"),
        prompt_tokens=int(inputs["input_ids"].shape[1]),
        compressed=compressed,
        report=report,
        baseline=baseline,
    )
