"""Where does a bundled model's decoder read the image, and where does its attention look?

Two measurements of the decoder, beside the tower's realism checks
(`lightkv_lab.tasks.photos.realism`):

* **Read by layer L.** The retained share (100 x accuracy over the uncompressed model's, first
  questions) when all but one of each image's tokens are dropped after decoder layer ``L``.
  This is FastV's stage at layer ``L`` with removal ``1 - 1/N``. A decoder that has read
  everything it needs by layer ``L`` keeps 100 here. In LLaVA-1.5-7B the question tokens
  gather the image in the middle layers (Zhang et al., "Cross-modal Information Flow in
  Multimodal Large Language Models", CVPR 2025): dropping every image token after layer 2
  of 32 is not harmless, as FastV's own 75%-at-K=2 loss shows.
* **Attention shift.** Take the last prompt token's attention over the image at each layer
  (mean over heads, normalised over the image) and report the share of it on the image's
  bottom half (rows are rastered top to bottom; uniform: 0.5). LLaVA-1.5's early layers put
  most of it on the last rows, the ones nearest the text (Endo et al., "Feather the
  Throttle", arXiv 2412.13180). That is why FastV keeps the bottom of the image.

    python -m lightkv_lab.bench.image_flow --model photos --episodes 300 --seed 5171 \
        --out runs/image-flow.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

import torch

__all__ = ["attention_shift", "read_by_layer", "run"]


def read_by_layer(model, convs, grid, base, batch: int = 100) -> dict[int, float]:
    """``{L: retained}``: all but one of each image's tokens dropped after decoder layer ``L``
    (``base``: the uncompressed `score` result on ``convs``)."""
    from lightkv_lab.bench.agreement import retained_pipeline
    from lightkv_lab.tasks import scoring as sc

    depth = model.config.text_config.num_hidden_layers
    n_img = grid_tokens(model, grid)
    ref = float(base.correct.double().mean())
    out = {}
    pipe, _ = retained_pipeline("fastv", depth, 0.5)
    for layer in range(depth - 1):
        sched = replace(pipe.scheduler, layers=(layer,), removal_ratios=(1 - 1 / n_img,))
        res = sc.score(model, convs, grid, pipe.with_scheduler(sched), batch=batch)
        out[layer] = 100 * float(res.correct.double().mean()) / ref
    return out


def grid_tokens(model, grid) -> int:
    from lightkv_lab.tasks.registry import task_for

    return task_for(grid).data.num_image_tokens(grid, model.config.vision_config.patch_size)


@torch.no_grad()
def attention_shift(model, convs, grid, batch: int = 50) -> dict[int, float]:
    """``{layer: share}``: the mean share of the last prompt token's image attention (mean over
    heads, normalised over the image) that falls on the image's bottom half."""
    from lightkv_lab.tasks.registry import task_for

    data = task_for(grid).data
    n_img = grid_tokens(model, grid)
    side = int(round(n_img**0.5))
    if side * side != n_img:
        raise ValueError(f"attention_shift needs a square token grid, got {n_img} tokens")
    bottom = torch.arange(n_img) >= (side // 2) * side
    from transformers.utils import logging as hf_logging

    lm = model.model.language_model
    before, level = lm.config._attn_implementation, hf_logging.get_verbosity()
    lm.config._attn_implementation = "eager"  # the weights: sdpa returns none
    hf_logging.set_verbosity_error()  # the tower stays on sdpa and says it returns no weights
    sums: dict[int, float] = {}
    try:
        for i in range(0, len(convs), batch):
            prompt = data.collate_prompts([c.first for c in convs[i : i + batch]], n_img)
            out = model(
                input_ids=prompt["input_ids"],
                attention_mask=prompt["attention_mask"],
                pixel_values=prompt["pixel_values"].to(model.dtype),
                output_attentions=True,
            )
            image = prompt["input_ids"] == model.config.image_token_id  # [B, L]
            for layer, att in enumerate(out.attentions):
                last = att[:, :, -1].mean(1)  # [B, L]
                rows = last[image].view(len(image), n_img)
                rows = rows / rows.sum(-1, keepdim=True)
                sums[layer] = sums.get(layer, 0.0) + float(rows[:, bottom].sum())
    finally:
        lm.config._attn_implementation = before
        hf_logging.set_verbosity(level)
    return {layer: s / len(convs) for layer, s in sums.items()}


def run(model_name: str, episodes: int, seed: int, batch: int = 100) -> dict[str, Any]:
    from lightkv_lab.tasks import model as dg
    from lightkv_lab.tasks import scoring as sc
    from lightkv_lab.tasks.tower_memo import TowerMemo

    model, _, grid = dg.load(dg.resolve_model(model_name))
    convs = sc.conversations(episodes, grid, seed=seed, followup=False)
    with TowerMemo(model):
        base = sc.score(model, convs, grid, None, batch=batch)
        read = read_by_layer(model, convs, grid, base, batch)
    shift = attention_shift(model, convs, grid)
    return {
        "model": str(model_name),
        "episodes": episodes,
        "seed": seed,
        "uncompressed_accuracy": float(base.correct.double().mean()),
        "retained_with_one_token_after_layer": read,
        "bottom_half_share_of_last_token_image_attention": shift,
    }


def main(argv: list[str] | None = None) -> dict:
    from lightkv.outputs import write_atomic

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="photos")
    p.add_argument("--episodes", type=int, default=300)
    p.add_argument("--seed", type=int, default=5171)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="a JSON file (written atomically)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.model, args.episodes, args.seed)
    text = json.dumps(result, indent=1)
    if args.out:
        write_atomic(args.out, text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
