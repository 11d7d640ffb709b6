"""``lightkv generate``: answer a prompt about an image with a compressed prefill.

With no ``--model`` it runs the bundled Scenes model (as ``lightkv demo`` does) on a held-out
Scenes image and question; ``--model scenes|digitgrid|symbolgrid`` names a bundled model in
every command, anything else is a model directory or hub id. The bundled models come with
the laboratory (``lightkv-lab``, found through the entry-point group ``lightkv.models``, see
`lightkv.lab`); without it, naming one (or giving no ``--model``) says in one line to install
it. The default pipeline fits the
model's depth (``lightkv`` where its schedule fits, else the kept-fraction preset
``lightkv-budget``), and the output says which and why; a bundled model given another image
says in one line that its answers mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .common import (
    EXIT_OK,
    UsageError,
    at_kept_fraction,
    at_most,
    kept_fraction,
    load_config_or_preset,
    require,
)

__all__ = ["add_commands"]

DEFAULT_MODEL = "scenes"
MAX_NEW_TOKENS = 32_768
"""The most tokens ``--max-new-tokens`` takes (a typo such as 99999999999 is refused at once)."""
"""The bundled model `generate` runs by default (the one `lightkv demo` shows)."""
DEEP_PRESET, SHALLOW_PRESET = "lightkv", "lightkv-budget"
"""The default pipeline where LightKV's own schedule fits the decoder, and where it does not."""


def add_commands(commands) -> None:
    """Add ``generate`` to the top-level subparsers."""
    fmt = argparse.HelpFormatter
    gen = commands.add_parser(
        "generate",
        help="answer a prompt about an image with a compressed prefill "
        "(optionally vs uncompressed)",
        description="Load a supported transformers model and its processor (a local directory or "
        "a hub id), answer PROMPT about IMAGE with greedy decoding while a pipeline compresses "
        "the vision tokens of the prefill, and print the answer with a short report: kept vision "
        "fraction, vision and total KV bytes with and without compression, time to first token "
        "and generate time. --compare also generates without compression.",
        formatter_class=fmt,
    )
    gen.add_argument(
        "--model",
        metavar="NAME|DIR|ID",
        default=DEFAULT_MODEL,
        help="a bundled model (scenes, digitgrid, symbolgrid), or a model directory or hub id "
        "with its processor (default: scenes, the bundled Scenes-VQA model)",
    )
    gen.add_argument(
        "--image",
        metavar="FILE",
        default=None,
        help="image file (any format Pillow reads; default with a bundled model: one of its "
        "held-out images; a bundled model answers only about images of its own task)",
    )
    gen.add_argument(
        "--prompt",
        metavar="TEXT",
        default=None,
        help="the question or instruction (default with a bundled model: a held-out question about "
        "that image)",
    )
    which = gen.add_mutually_exclusive_group()
    which.add_argument(
        "--preset",
        metavar="NAME",
        help=f"a preset (see `lightkv presets`; default: {DEEP_PRESET} where "
        f"its schedule fits the model's depth, else {SHALLOW_PRESET}, which fits any depth)",
    )
    which.add_argument("--config", metavar="FILE", help="a pipeline YAML file")
    gen.add_argument(
        "--kept-fraction",
        type=kept_fraction,
        metavar="T",
        help="the pipeline at this kept vision-KV fraction in (0, 1] on the model's depth (its "
        "kept_fraction; a fraction the method cannot reach there is refused, naming the nearest)",
    )
    gen.add_argument(
        "--compare", action="store_true", help="also generate without compression and compare"
    )
    gen.add_argument(
        "--max-new-tokens",
        type=at_most(
            MAX_NEW_TOKENS, "each is one decoding step, and the whole answer stays in the cache"
        ),
        default=32,
        metavar="N",
        help="tokens to generate (default: 32)",
    )
    gen.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    gen.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available"
    )
    gen.add_argument(
        "--repeats",
        type=at_most(20, "each is a whole generation per variant"),
        default=3,
        metavar="N",
        help="timed generate calls per variant; times are their medians (default: 3)",
    )
    gen.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    gen.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    require("PIL", why="(pillow) to read images")
    import logging

    import torch
    from transformers.utils import logging as hf_logging

    from .. import generate as g
    from .. import lab
    from ..config import ConfigError

    if args.preset and (
        "/" in args.preset or os.sep in args.preset or args.preset.endswith((".yaml", ".yml"))
    ):
        raise UsageError(f"--preset takes a preset name; use --config for the file {args.preset!r}")
    names = lab.bundled_models()
    found = lab.bundled_model(args.model) if args.model in names else None
    if found is None and args.model in lab.LAB_MODELS and not os.path.isdir(args.model):
        raise UsageError(lab.needs_lab(f"--model {args.model} (a bundled model)"))
    bundled = args.model if found is not None else None
    model_path = str(found.path) if found is not None else args.model
    if not bundled and (args.image is None or args.prompt is None):
        raise UsageError(
            f"--image and --prompt are required with --model {args.model} (they default only for "
            f"the bundled models: {', '.join(names or lab.LAB_MODELS)})"
        )
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError(
            "--prompt is empty; give a question, or leave --prompt out for a bundled model's "
            "default"
        )
    notes = []
    if args.config or args.preset:
        target = args.config or args.preset
    else:
        target, why = _default_preset(g.decoder_depth(model_path))
        notes.append(why)
    cfg = at_kept_fraction(load_config_or_preset(target), args.kept_fraction)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    hub_log = logging.getLogger("huggingface_hub")
    hub_level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # no network: one error line, not a warning per retry
    quiet = not sys.stderr.isatty() and hf_logging.is_progress_bar_enabled()
    if quiet:  # keep piped stderr to the one-line errors
        hf_logging.disable_progress_bar()
    example = None
    try:
        prompt = args.prompt
        if args.image is not None:
            image = g.load_image(args.image)  # before loading a possibly large model
            if bundled:
                notes.append(
                    f"the bundled {bundled} model was trained only on its own synthetic {bundled} "
                    "images: its answers about any other image mean nothing"
                )
        else:
            assert found is not None  # --image is required unless the model is bundled (above)
            image, question = found.example()
            prompt = prompt or question["question"]
            example = {
                "image": f"a held-out {bundled} image",
                "prompt": prompt,
                "expected_answer": question["answer"],
            }
            if not args.json:  # with --json, stdout is exactly one JSON document
                print(f"image: {example['image']}")
                print(f"prompt: {prompt!r} (expected answer: {question['answer']!r})")
        loaded = g.load_model(model_path, dtype=dtype, device=device, check=cfg)
        inputs = g.build_inputs(loaded, image, prompt)
        result = g.run(
            loaded,
            inputs,
            cfg.build(),
            compare=args.compare,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
        )
    except g.GenerateError as e:
        raise UsageError(str(e)) from None
    except ConfigError as e:  # e.g. a schedule deeper than the model: name the file or preset
        raise (
            e if e.source else e.with_source(target if args.config else f"preset {target}")
        ) from None
    finally:
        hub_log.setLevel(hub_level)
        if quiet:
            hf_logging.enable_progress_bar()
    result.notes.extend(notes)
    if result.report.missed_target:  # stderr, so a --json stdout stays one document
        print(f"lightkv: warning: {result.report.missed_target}", file=sys.stderr)
    if args.json:
        out = result.to_dict()
        if example is not None:
            out["example"] = example
        print(json.dumps(out, indent=2, ensure_ascii=False))
    else:
        print(result.format())
    return EXIT_OK


def _default_preset(layers: int | None) -> tuple[str, str]:
    """``(preset, why)``: `DEEP_PRESET` where its schedule fits a decoder of ``layers``,
    else `SHALLOW_PRESET` (a kept-fraction schedule that fits any depth)."""
    from ..config import ConfigError

    if layers is None:
        return (
            DEEP_PRESET,
            f"preset {DEEP_PRESET} (the default; the model's depth could not be read from its "
            "config)",
        )
    try:
        load_config_or_preset(DEEP_PRESET).validate_for_model(layers)
    except (ConfigError, ValueError):
        return SHALLOW_PRESET, (
            f"preset {SHALLOW_PRESET} (the default for this {layers}-layer decoder: "
            f"{DEEP_PRESET}'s schedule needs a deeper one; --preset chooses another)"
        )
    return (
        DEEP_PRESET,
        f"preset {DEEP_PRESET} (the default: its schedule fits this {layers}-layer decoder)",
    )
