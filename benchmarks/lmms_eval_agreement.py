"""lightkv's evaluator, the scorer of ``lightkv bench quality`` and lmms-eval agree: the same
held-out DigitGrid episodes, three paths, the same numbers.

For each method (uncompressed, the presets ``lightkv-budget`` and ``fastv``, and LightKV and
FastV at ``lightkv bench quality``'s 25% target, given to lmms-eval as YAML files) on the
bundled DigitGrid model: exact match from `lightkv_lab.tasks.evaluate.evaluate` (batched
``generate``), from `lightkv_lab.tasks.scoring.score` (the teacher-forced scorer behind
``lightkv bench quality``, first turn), and from ``python -m lmms_eval --model lightkv`` on a
local task built from the same episodes (`lightkv_lab.digitgrid_task`), with the kept vision
fraction each path reports. Needs the lmms-eval extra (``make lmms-eval``):

    python benchmarks/lmms_eval_agreement.py              # 200 episodes, ~7 min on 2 CPU cores
    python benchmarks/lmms_eval_agreement.py --episodes 48

Writes ``benchmarks/results/lmms-eval-agreement.json`` and ``lmms-eval-agreement.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from lightkv.outputs import write_atomic

RESULTS = Path(__file__).resolve().parent / "results"
# name: a preset, or (preset, kept-fraction target) put there the way `lightkv bench quality`
# puts it (the library's knob, `lightkv_lab.bench.budgets.knob_pipeline`), given to lmms-eval
# as a YAML config
METHODS = {
    "uncompressed": None,
    "lightkv-budget": "lightkv-budget",
    "fastv": "fastv",
    "lightkv @ 25%": ("lightkv", 0.25),
    "fastv @ 25%": ("fastv", 0.25),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--batch", type=int, default=25)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    from lightkv_lab.bench.budgets import knob_pipeline
    from lightkv_lab.digitgrid_task import (
        TASK_NAME,
        lmms_eval_command,
        offline_env,
        read_run,
        task_episodes,
        write_task,
    )
    from lightkv_lab.tasks import evaluate as ev
    from lightkv_lab.tasks import model as dg
    from lightkv_lab.tasks.scoring import Conversation, score

    import lightkv

    model, processor, grid = dg.load()
    episodes = task_episodes(args.episodes, processor, grid)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        task_dir = write_task(tmp / "task", episodes, grid)
        for name, preset in METHODS.items():
            if isinstance(preset, tuple):
                pipe, _ = knob_pipeline(
                    preset[0], model.config.text_config.num_hidden_layers, preset[1]
                )
                config = tmp / f"{preset[0]}-{preset[1]}.yaml"
                lightkv.to_yaml(pipe, config)
                extra = f",config={config}"
            else:
                pipe = lightkv.load(preset) if preset else None
                extra = f",preset={preset}" if preset else ""
            own = ev.evaluate(model, episodes, grid, pipe, batch=args.batch)
            scored = score(
                model, [Conversation(ep) for ep in episodes], grid, pipe, batch=args.batch
            )
            model_args = "pretrained=digitgrid,dtype=float32" + extra
            cmd = lmms_eval_command(task_dir, tmp / name, model_args, batch_size=args.batch)
            proc = subprocess.run(
                cmd, check=False, capture_output=True, text=True, env=offline_env(), cwd=tmp
            )
            results, samples = read_run(tmp / name, log=proc.stdout + proc.stderr)
            answers = [
                s["filtered_resps"]
                if isinstance(s["filtered_resps"], str)
                else s["filtered_resps"][0]
                for s in samples
            ]
            lk = results.get("throughput", {})
            rows.append(
                {
                    "method": name,
                    "episodes": len(episodes),
                    "evaluator_exact_match": own.overall,
                    "scorer_exact_match": float(scored.correct.double().mean()),
                    "lmms_eval_exact_match": results["results"][TASK_NAME]["exact_match,none"],
                    "evaluator_kept_fraction": own.kept_fraction,
                    "scorer_kept_fraction": scored.kept_fraction,
                    "lmms_eval_kept_fraction": lk.get("avg_lightkv_kept_vision_fraction"),
                    "same_answers": sum(a.split() == b for a, b in zip(answers, own.answers)),
                }
            )
            print(json.dumps(rows[-1]))
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "lmms-eval-agreement.json", json.dumps(rows, indent=2) + "\n")
    write_atomic(args.out / "lmms-eval-agreement.md", markdown(rows))
    print(markdown(rows))
    return 0


def markdown(rows: list[dict]) -> str:
    n = rows[0]["episodes"] if rows else 0
    lines = [
        (
            f"Exact match on the same {n} held-out DigitGrid episodes (bundled model), three "
            "paths; kept vision fraction as each path reports it "
            "(`benchmarks/lmms_eval_agreement.py`)."
        ),
        "",
        (
            "| method | lightkv evaluator | `lightkv bench quality` scorer | lmms-eval `--model "
            "lightkv` | kept (evaluator) | kept (scorer) | kept (lmms-eval) | same answers "
            "(evaluator vs lmms-eval) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kept_lmms = (
            "n/a" if r["lmms_eval_kept_fraction"] is None else f"{r['lmms_eval_kept_fraction']:.4f}"
        )
        lines.append(
            f"| {r['method']} | {r['evaluator_exact_match']:.4f} | {r['scorer_exact_match']:.4f} | "
            f"{r['lmms_eval_exact_match']:.4f} | {r['evaluator_kept_fraction']:.4f} | "
            f"{r['scorer_kept_fraction']:.4f} | {kept_lmms} | {r['same_answers']}/{r['episodes']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
