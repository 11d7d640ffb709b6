"""Measure each released-code quirk against lightkv-paper on the tiny random LLaVA-1.5 and
Qwen2.5-VL models (the numbers in docs/concepts/graph.md): the largest prefill logit
difference at the next-token column and greedy agreement over 8 new tokens, for 6 prompts.

    python docs/scripts/measure_released.py
"""

from __future__ import annotations

import dataclasses

import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.adapters import apply
from lightkv.policies import ExplicitSchedule, QueryAxisSoftmax
from lightkv.quirks import ReleasedQuirks

SCHEDULE = ExplicitSchedule(
    layers=(1, 2), windows_per_side=(2, 1), removal_ratios=(0.5,)
)  # 4-layer models
GEN = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)


def variants(family: str) -> dict[str, lightkv.Pipeline]:
    base = lightkv.load(
        "lightkv-paper" if family == "llava" else "lightkv-paper-qwen2_5_vl"
    ).with_scheduler(SCHEDULE)
    out = {
        "renumber_positions": dataclasses.replace(
            base, released_quirks=ReleasedQuirks(renumber_positions=True)
        ),
        "unmasked_first_merge": dataclasses.replace(
            base, released_quirks=ReleasedQuirks(unmasked_first_merge=True)
        ),
        "eager_merge_layers": dataclasses.replace(
            base, released_quirks=ReleasedQuirks(eager_merge_layers=True)
        ),
    }
    if family == "llava":
        out["random relevance"] = dataclasses.replace(
            base, relevance=lightkv.policies.RandomRelevance()
        )
    name = "lightkv-paper-released" + ("" if family == "llava" else "-qwen2_5_vl")
    out[name] = lightkv.load(name).with_scheduler(SCHEDULE)
    assert isinstance(base.relevance, QueryAxisSoftmax)
    return {"base": base, **out}


def run(pipe, model, batch):
    with apply(pipe, model), torch.no_grad():
        return model.generate(**batch, **GEN)


def main() -> None:
    for family in ("llava", "qwen2_5_vl"):
        fam = TINY_MODELS[family]
        model = fam.build()
        images = (lambda k: [(1, 16, 16)] * k) if family == "qwen2_5_vl" else (lambda k: k)
        batches = [
            fam.collate([fam.row(model, images=images(1 + s % 2), seed=s)]) for s in range(6)
        ]
        pipes = variants(family)
        base = [run(pipes["base"], model, b) for b in batches]
        scale = max(float(g.logits[0].abs().max()) for g in base)
        print(f"{family}: largest |logit| {scale:.2g}")
        for name, pipe in pipes.items():
            if name == "base":
                continue
            diffs, agree = [], 0
            for b, ref in zip(batches, base):
                got = run(pipe, model, b)
                diffs.append(float((got.logits[0] - ref.logits[0]).abs().max()))
                agree += bool(torch.equal(got.sequences, ref.sequences))
            print(
                f"  {name:36s} max |dlogit| {min(diffs):.2g}-{max(diffs):.2g}   greedy equal "
                f"{agree}/6"
            )


if __name__ == "__main__":
    main()
