"""Variants of LightKV against the reference and the baselines at equal budget (``lightkv bench
ablation``).

Each variant is the ``lightkv`` preset with one or two policies swapped (`VARIANTS`): merge
weights that count how many originals a token stands for, splits and budgets where prompt
relevance decides who may leave, and relevance computed other ways. At each kept fraction
(`TARGETS`, 55% and 40%) every variant and every baseline (`BASELINES`) runs with the same
depth-scaled schedule machinery as the quality benchmark (`lightkv_lab.bench.quality`), on the
same held-out conversations in the same batches, and is scored teacher-forced: exact match
per question type, KL to the uncompressed answer distribution, with paired bootstrap 95%
intervals of lightkv minus each method. `write_outputs` writes ``ablation.json``, ``.md``
and ``.png``.

```python
from lightkv_lab.bench.ablation import AblationConfig, run
result = run(AblationConfig(models=("digitgrid",), episodes=24, targets=(0.55,),
                            variants=("size-aware messages",), baselines=("tome",)))
```
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lightkv.outputs import write_atomic
from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.bench.quality import RESULTS, AccuracyConfig, _row
from lightkv_lab.bench.quality_report import accuracy_cell, detail_accuracy

__all__ = [
    "BASELINES",
    "TARGETS",
    "VARIANTS",
    "AblationConfig",
    "markdown_table",
    "plot",
    "run",
    "variant_pipeline",
    "write_outputs",
]

VARIANTS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "size-aware messages": {"passer": ("relevance_size_mean", {})},
    "size-weighted mean (ToMe's)": {"passer": ("size_mean", {})},
    "relevance split": {"partitioner": ("relevance_split", {"sources": "ratio"})},
    "relevance split + budget": {
        "partitioner": ("relevance_split", {"sources": 0.75}),
        "pruner": ("relevance_budget", {}),
    },
    "relevance: max over heads": {"relevance": ("query_softmax", {"heads": "max"})},
    "relevance: last token": {"relevance": ("last_token", {})},
    "relevance: text attention": {"relevance": ("text_attention", {})},
    "relevance off": {"relevance": ("uniform", {})},
    "proportional attention": {"proportional_attention": True},
}
"""LightKV with parts swapped: policy family -> (registered name, parameters), or a pipeline
option -> its value (``proportional_attention``)."""
BASELINES = ("lightkv", "lightkv-paper", "tome", "fastv", "pdrop", "random")
TARGETS = (0.55, 0.40)


@dataclass(frozen=True)
class AblationConfig:
    """What to run."""

    models: tuple[str, ...] = ("symbolgrid", "digitgrid")
    """Bundled model names or model directories."""
    episodes: int = 240
    """Held-out conversations per model (question types in equal shares)."""
    targets: tuple[float, ...] = TARGETS
    variants: tuple[str, ...] = tuple(VARIANTS)
    baselines: tuple[str, ...] = BASELINES
    followup: bool = True
    batch: int = 120
    seed: int = 0
    bootstrap: int = 2000
    threads: int | None = None


def variant_pipeline(name: str, num_layers: int, target: float):
    """``(pipeline, how)``: the ``lightkv`` preset at ``target`` with `VARIANTS` ``[name]`` swapped
    in."""
    from lightkv.policies import FAMILIES

    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; choose from: {', '.join(VARIANTS)}")
    pipe, how = knob_pipeline("lightkv", num_layers, target)
    swaps = {
        key: FAMILIES[key].create(*value[:1], **value[1]) if key in FAMILIES else value
        for key, value in VARIANTS[name].items()
    }
    return replace(pipe, name=f"lightkv ({name})", **swaps), how


def run(config: AblationConfig = AblationConfig(), progress: bool = True) -> dict[str, Any]:
    """Run every model; returns the JSON-able result (per model, rows per target and method).
    With ``progress``, a bar on a terminal (`lightkv_lab.bench.progress.Progress`)."""
    from lightkv_lab.bench.progress import Progress
    from lightkv_lab.tasks import model as dg
    from lightkv_lab.tasks import scoring as sc

    if config.threads:
        torch.set_num_threads(config.threads)
    unknown = [v for v in config.variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant {unknown[0]!r}; choose from: {', '.join(VARIANTS)}")
    t0 = time.time()
    # the quality benchmark's row builder reads its intervals' settings from this
    q_cfg = AccuracyConfig(bootstrap=config.bootstrap, seed=config.seed)
    models = []
    runs_per_model = 1 + len(config.targets) * (len(config.baselines) + len(config.variants))
    bar = Progress(runs_per_model * len(config.models), "ablation", quiet=not progress)
    for name in config.models:
        path = dg.resolve_model(name)
        model, _, grid = dg.load(path)
        task = dg.read_task(path)
        layers = model.config.text_config.num_hidden_layers
        convs = sc.conversations(config.episodes, grid, seed=config.seed, followup=config.followup)
        base = sc.score(model, convs, grid, None, batch=config.batch)
        bar.step(f"{name} uncompressed")
        rows = []
        for target in config.targets:
            runs = [(m, *knob_pipeline(m, layers, target)) for m in config.baselines]
            runs += [
                (f"lightkv ({v})", *variant_pipeline(v, layers, target)) for v in config.variants
            ]
            scores = {}
            for m, pipe, how in runs:
                scores[m] = (how, pipe, sc.score(model, convs, grid, pipe, batch=config.batch))
                bar.step(f"{name} {m} at {target:.2f}")
            light = scores["lightkv"][2] if "lightkv" in scores else None
            for m, (how, pipe, res) in scores.items():
                rows.append(_row(m, target, how, pipe.scheduler, res, base, light, q_cfg))
        models.append(
            {
                "name": name,
                "task": task.name,
                "layers": layers,
                "vision_tokens": task.data.num_image_tokens(
                    grid, model.config.vision_config.patch_size
                ),
                "qtypes": list(task.asked(grid)),
                "detail_qtypes": list(getattr(task.data, "DETAIL_QTYPES", ("what",))),
                "uncompressed": _row("uncompressed", 1.0, "scaled", None, base, base, None, q_cfg),
                "rows": rows,
            }
        )
    bar.close()
    return {
        "benchmark": "ablation",
        "config": asdict(config),
        "variants": {k: VARIANTS[k] for k in config.variants},
        "models": models,
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "seconds": time.time() - t0,
    }


def _ci(v) -> str:
    if not v:
        return "-"
    m, lo, hi = (100 * x for x in v)
    return f"{m:+.1f} [{lo:+.1f}, {hi:+.1f}]"


def markdown_table(result: dict[str, Any]) -> str:
    """One table per model and target: accuracy per type, KL, and lightkv minus each method."""
    lines = []
    for m in result["models"]:
        cols = list(dict.fromkeys(m["qtypes"])) + (
            ["followup"] if "followup" in m["uncompressed"]["accuracy"] else []
        )
        detail = m["detail_qtypes"][0]
        title = (
            f"## {m['name']} ({m['task']}, {m['vision_tokens']} vision tokens, {m['layers']} "
            f"layers, {result['config']['episodes']} conversations)"
        )
        lines += [
            title,
            "",
            "Uncompressed: "
            + ", ".join(f"{q} {accuracy_cell(m['uncompressed'], q)}" for q in cols),
            "",
        ]
        for target in result["config"]["targets"]:
            intro = (
                f"At {target:.0%} kept. Last columns: lightkv minus this method, in points of "
                f"`{detail}` accuracy and of overall accuracy, paired bootstrap 95% intervals "
                "(positive: lightkv better)."
            )
            header = (
                "| method | kept | " + " | ".join(cols) + f" | KL | lightkv - this, {detail} | "
                "lightkv - this, overall |"
            )
            lines += [intro, "", header, "|---" * (len(cols) + 5) + "|"]
            for r in (r for r in m["rows"] if r["target"] == target):
                vs = r.get("vs_baseline", {}).get("accuracy", {})
                lines.append(
                    f"| {r['method']} | {r['kept_fraction']:.3f} | "
                    + " | ".join(accuracy_cell(r, q) for q in cols)
                    + f" | {r['kl']['overall']:.2e} | {_ci(vs.get(detail))} | "
                    f"{_ci(vs.get('overall'))} |"
                )
            lines.append("")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Detail accuracy of every method, one panel per model, bars per target."""
    from lightkv_lab import vis

    plt = vis.pyplot()
    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 5.5), squeeze=False)
    targets = result["config"]["targets"]
    for ax, m in zip(axes[0], models):
        methods = list(dict.fromkeys(r["method"] for r in m["rows"]))
        width = 0.8 / len(targets)
        for j, t in enumerate(targets):
            vals = [
                next(
                    detail_accuracy(r, m)
                    for r in m["rows"]
                    if r["method"] == k and r["target"] == t
                )
                for k in methods
            ]
            ax.barh(
                [i + j * width for i in range(len(methods))],
                vals,
                height=width,
                label=f"{t:.0%} kept",
            )
        ax.axvline(
            detail_accuracy(m["uncompressed"], m), color="k", lw=1, ls="--", label="uncompressed"
        )
        ax.set_yticks(
            [i + width * (len(targets) - 1) / 2 for i in range(len(methods))], methods, fontsize=8
        )
        ax.invert_yaxis()
        ax.set_xlabel(f"held-out exact match, detail questions ({', '.join(m['detail_qtypes'])})")
        ax.set_title(
            f"{m['name']}: {m['vision_tokens']} vision tokens, {m['layers']} layers", fontsize=10
        )
        ax.grid(alpha=0.3, axis="x")
        ax.legend(fontsize=8)
    vis.save_figure(fig, path)


def write_outputs(result: dict[str, Any], out: Path = RESULTS) -> list[Path]:
    """``ablation.json``, ``ablation.md`` and ``ablation.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "ablation.json", out / "ablation.md", out / "ablation.png"]
    for path, text in zip(paths, [json.dumps(result, indent=1) + "\n", markdown_table(result)]):
        write_atomic(path, text)  # both rendered before either is written
    plot(result, paths[2])
    return paths
