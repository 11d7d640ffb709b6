"""``lightkv generate``: answer a prompt about an image with a compressed prefill."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .common import EXIT_OK, UsageError, depth, load_config_or_preset, require

__all__ = ["add_commands"]


def add_commands(commands) -> None:
    """Add ``generate`` to the top-level subparsers."""
    fmt = argparse.HelpFormatter
    gen = commands.add_parser(
        "generate",
        help="answer a prompt about an image with a compressed prefill (optionally vs uncompressed)",
        description="Load a supported transformers model and its processor (a local directory or a hub id), "
        "answer PROMPT about IMAGE with greedy decoding while a pipeline compresses the vision tokens of the "
        "prefill, and print the answer with a short report: kept vision fraction, vision and total KV bytes "
        "with and without compression, time to first token and generate time. --compare also generates "
        "without compression.",
        formatter_class=fmt,
    )
    gen.add_argument("--model", metavar="DIR|ID", default=None,
                     help="model directory (or hub id) with its processor (default: the bundled DigitGrid LVLM, whose processor takes any image)")
    gen.add_argument("--image", metavar="FILE", default=None,
                     help="image file (any format Pillow reads; default with the bundled model: a held-out DigitGrid image)")
    gen.add_argument("--prompt", metavar="TEXT", default=None,
                     help="the question or instruction (default with the bundled model: a question about that image)")
    which = gen.add_mutually_exclusive_group()
    which.add_argument("--preset", metavar="NAME", help="a preset (see `lightkv presets`; default: lightkv-budget "
                       "with the bundled model, lightkv with --model)")
    which.add_argument("--config", metavar="FILE", help="a pipeline YAML file")
    gen.add_argument("--compare", action="store_true", help="also generate without compression and compare")
    gen.add_argument("--max-new-tokens", type=depth, default=32, metavar="N", help="tokens to generate (default: 32)")
    gen.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                     help="default: float32 on CPU, bfloat16 on CUDA")
    gen.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    gen.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    gen.set_defaults(func=_cmd_generate)


def _cmd_generate(args: argparse.Namespace) -> int:
    require("PIL", why="(pillow) to read images")
    import logging

    import torch
    from transformers.utils import logging as hf_logging

    from .. import generate as g
    from ..config import ConfigError

    if args.preset and ("/" in args.preset or os.sep in args.preset or args.preset.endswith((".yaml", ".yml"))):
        raise UsageError(f"--preset takes a preset name; use --config for the file {args.preset!r}")
    from ..tasks.model import BUNDLED_MODEL

    bundled = args.model is None
    model_path = str(BUNDLED_MODEL) if bundled else args.model
    if not bundled and (args.image is None or args.prompt is None):
        raise UsageError("--image and --prompt are required with --model (they default only for the bundled model)")
    if args.prompt is not None and not args.prompt.strip():
        raise UsageError("--prompt is empty; give a question, or leave --prompt out for the bundled model's default")
    # the bundled model has 6 layers: the 32-layer 'lightkv' schedule does not fit it
    target = args.config if args.config else (args.preset or ("lightkv-budget" if bundled else "lightkv"))
    cfg = load_config_or_preset(target)
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
        else:
            image, question = _digitgrid_example()
            prompt = prompt or question["question"]
            example = {"image": f"a held-out DigitGrid image ({question['grid']})", "prompt": prompt,
                       "expected_answer": question["answer"]}
            if not args.json:  # with --json, stdout is exactly one JSON document
                print(f"image: {example['image']}")
                print(f"prompt: {prompt!r} (expected answer: {question['answer']!r})")
        loaded = g.load_model(model_path, dtype=dtype, device=device, check=cfg)
        inputs = g.build_inputs(loaded, image, prompt)
        result = g.run(loaded, inputs, cfg.build(), compare=args.compare, max_new_tokens=args.max_new_tokens)
    except g.GenerateError as e:
        raise UsageError(str(e)) from None
    except ConfigError as e:  # e.g. a schedule deeper than the model: name the file or preset
        raise (e if e.source else e.with_source(target if args.config else f"preset {target}")) from None
    finally:
        hub_log.setLevel(hub_level)
        if quiet:
            hf_logging.enable_progress_bar()
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


def _digitgrid_example():
    """A held-out DigitGrid image (PIL) and a cell question about it, for the bundled model."""
    import random

    from ..tasks.digitgrid import data
    from ..tasks.model import BUNDLED_MODEL, read_grid_config

    grid = read_grid_config(BUNDLED_MODEL)
    ep = data.make_episode(random.Random("generate-example"), "heldout", "what", grid)
    cells = " / ".join(" ".join("." if v < 0 else str(v) for v in row) for row in ep.grid.tolist())
    return data.to_pil(ep.image), {"question": " ".join(ep.question), "answer": " ".join(ep.answer),
                                   "grid": f"cells by row: {cells}"}
