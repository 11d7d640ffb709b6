"""Accuracy vs kept vision KV on DigitGrid-VQA, for every method, with the bundled model.

The bundled DigitGrid LVLM (`lightkv.digitgrid.model`) answers held-out questions whose
answer lives in one image region. Each method (preset) runs at several kept-fraction
targets; its schedule is first scaled from the reference 32-layer depth to the model's
(`lightkv.bench.efficiency.scale_layers`), then one common per-stage ratio is chosen so that
the vision KV kept on average over layers hits the target (`budget_schedule`). Where a
method cannot remove that much (a merge stage with a parity split removes at most half of
its window; 2x2 pooling at most three quarters), its stages move earlier, then it gets a
stage after every layer (``how: "extra stages"``), and if even that is not enough it runs
at its smallest reachable fraction (``how: "min"``). 100% is the uncompressed model, shared
by all methods.

Measured per (method, target): accuracy per question type and overall, the kept fraction
actually realised (from the session report, averaged over layers and episodes), vision KV
bytes per episode. Writes ``quality.json``, ``quality.md`` (tables), ``quality.png``
(accuracy vs kept fraction, one line per method) and ``quality-provenance.png`` (one cell
question: which tokens merged into which, with and without prompt relevance).

```python
from lightkv.bench.quality import AccuracyConfig, run
result = run(AccuracyConfig(episodes=200, methods=("lightkv", "fastv"), targets=(1.0, 0.55)))
```
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

__all__ = ["METHODS", "TARGETS", "AccuracyConfig", "budget_schedule", "markdown_table", "method_pipeline",
           "run", "write_outputs"]

METHODS = ("lightkv", "lightkv-paper", "lightkv-no-relevance", "tome", "fastv", "pdrop", "random", "pool")
TARGETS = (1.0, 0.75, 0.55, 0.40, 0.25)
REF_DEPTH = 32
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

MAX_RATIO = {"fastv": 0.95, "pdrop": 0.95, "random": 0.95, "pool": 0.75}
"""The most a stage of each method can remove; 0.5 (a parity split) for the others."""


@dataclass(frozen=True)
class AccuracyConfig:
    """What to run."""

    model: str | None = None
    """Model directory (default: the bundled DigitGrid model)."""
    episodes: int = 2000
    methods: tuple[str, ...] = METHODS
    targets: tuple[float, ...] = TARGETS
    batch: int = 100
    seed: int = 0
    threads: int | None = None


def budget_schedule(layers: Sequence[int], num_layers: int, target: float, max_ratio: float = 0.5,
                    windows_per_side: Sequence[int] | None = None, window_size=None, tolerance: float = 0.02):
    """``(ExplicitSchedule, how)`` keeping about ``target`` of the vision KV.

    Placements are tried in order: ``layers`` (already at the model's depth), then the same
    stages moved earlier by 1, 2, ... layers (spacing kept), then a stage after every layer
    but the last (the deepest compression a method with this per-stage ``max_ratio`` can
    make; per-stage windows repeat their last entry). The first placement that can keep
    ``target + tolerance`` or less gets one common ratio ``<= max_ratio`` by bisection on
    `average_kept_fraction`. ``how`` is ``"scaled"`` (the method's own stages), ``"extra
    stages"`` (a stage after every layer) or ``"min"`` (out of reach: the deepest placement
    at ``max_ratio``). The tolerance keeps e.g. LightKV's own 0.5 ratio at its scaled layers
    for a 55% target on 6 layers (56.25%) rather than moving it.
    """
    from ..policies.schedulers import (
        ExplicitSchedule,
        StageSpec,
        average_kept_fraction,
        ratio_for_target,
    )

    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be in (0, 1], got {target}")
    if target >= 1.0:
        return ExplicitSchedule(layers=(), ratios=(), windows_per_side=None), "scaled"
    layers = list(layers)
    placements = [(tuple(l - shift for l in layers), "scaled") for shift in range(layers[0] + 1)]
    placements.append((tuple(range(num_layers - 1)), "extra stages"))

    def kept(p: float, at: tuple[int, ...]) -> float:
        return average_kept_fraction([StageSpec(l, p, windows_per_side=1) for l in at], num_layers)

    def per_stage(values, n: int):
        values = [tuple(v) if isinstance(v, (list, tuple)) else v for v in values]
        return tuple(values[:n]) + (values[-1],) * max(0, n - len(values))

    def build(p: float, at: tuple[int, ...]):
        extra: dict[str, Any] = {"windows_per_side": None}
        if window_size is not None:
            extra["window_size"] = per_stage(window_size, len(at))
        elif windows_per_side is not None:
            extra["windows_per_side"] = per_stage(windows_per_side, len(at))
        return ExplicitSchedule(layers=at, ratios=(p,), **extra)

    for at, how in placements:
        if kept(max_ratio, at) <= target + tolerance:
            return build(round(ratio_for_target(lambda p, at=at: kept(p, at), target, max_ratio), 4), at), how
    return build(max_ratio, placements[-1][0]), "min"


def method_pipeline(name: str, num_layers: int, target: float):
    """``(pipeline, how)``: preset ``name`` scaled to ``num_layers`` at ``target`` (see
    `budget_schedule` for ``how``)."""
    from ..pipeline import Pipeline
    from ..policies.schedulers import ExplicitSchedule
    from .efficiency import scale_layers

    pipe = Pipeline.from_preset(name)
    sched = pipe.scheduler
    if not isinstance(sched, ExplicitSchedule):
        raise TypeError(f"preset {name!r} has no explicit schedule to scale")
    layers = scale_layers(sched.layers, REF_DEPTH, num_layers)
    schedule, how = budget_schedule(layers, num_layers, target, MAX_RATIO.get(name, 0.5),
                                    windows_per_side=sched.windows_per_side, window_size=sched.window_size)
    return replace(pipe, scheduler=schedule), how


def run(config: AccuracyConfig = AccuracyConfig(), progress: bool = True) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-able result."""
    from ..digitgrid import evaluate as ev
    from ..digitgrid import model as dg

    if config.threads:
        torch.set_num_threads(config.threads)
    model, _, grid = dg.load(config.model or dg.BUNDLED_MODEL)
    num_layers = model.config.text_config.num_hidden_layers
    episodes = ev.heldout_episodes(config.episodes, seed=config.seed, grid=grid)
    rows: list[dict[str, Any]] = []
    t0 = time.time()

    def log(msg: str) -> None:
        if progress:
            print(f"[{time.time() - t0:6.0f}s] {msg}", flush=True)

    base = ev.evaluate(model, episodes, grid, None, batch=config.batch)
    log(f"uncompressed: {base.overall:.4f} {base.accuracy}")
    for name in config.methods:
        for target in config.targets:
            if target >= 1.0:
                rows.append({"method": name, "target": 1.0, "how": "scaled", "schedule": None, **base.to_dict()})
                continue
            pipe, how = method_pipeline(name, num_layers, target)
            res = ev.evaluate(model, episodes, grid, pipe, batch=config.batch)
            sched = pipe.scheduler
            rows.append({"method": name, "target": target, "how": how,
                         "schedule": {"layers": list(sched.layers), "ratios": list(sched.ratios)}, **res.to_dict()})
            log(f"{name:22s} target {target:.2f} kept {res.kept_fraction:.3f} acc {res.overall:.4f} "
                + " ".join(f"{q}={a:.3f}" for q, a in res.accuracy.items()))
    relevance = ev.relevance_mass(model, episodes, grid)
    log(f"relevance mass on the asked cell: {relevance['layers']}")
    return {
        "benchmark": "digitgrid-quality",
        "relevance_mass": relevance,
        "config": asdict(config),
        "model": {"path": str(config.model or dg.BUNDLED_MODEL), "layers": num_layers,
                  "vision_tokens": (grid.image_size // model.config.vision_config.patch_size) ** 2},
        "grid": asdict(grid),
        "uncompressed": base.to_dict(),
        "rows": rows,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "seconds": time.time() - t0,
    }


def markdown_table(result: dict[str, Any]) -> str:
    """Accuracy per method (rows) and target (columns), with realised kept fractions."""
    rows = result["rows"]
    targets = sorted({r["target"] for r in rows}, reverse=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    head = "| method | " + " | ".join(f"{t:.0%} target" for t in targets) + " |"
    lines = [head, "|---" * (len(targets) + 1) + "|"]
    for m in methods:
        cells = []
        for t in targets:
            r = next((r for r in rows if r["method"] == m and r["target"] == t), None)
            if r is None:
                cells.append("")
                continue
            flag = {"scaled": "", "extra stages": " (+stages)", "min": " (min)"}[r["how"]]
            cells.append(f"{r['overall']:.3f} @ {r['kept_fraction']:.2f}{flag}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    rel = result.get("relevance_mass")
    if rel:
        intro = (f"Share of the image's relevance mass on the asked cell vs another occupied cell "
                 f"('what' questions about occupied cells, {rel['episodes']} episodes; area share of a cell "
                 f"{rel['area_share']:.3f}):")
        lines += ["", intro, "",
                  "| after layer | query-axis ξ: asked | control | last-token attention: asked | control |",
                  "|---|---|---|---|---|"]
        for layer, d in rel["layers"].items():
            q, t = d["query_softmax"], d["last_token"]
            lines.append(f"| {layer} | {q['asked']:.3f} | {q['control']:.3f} | {t['asked']:.3f} | {t['control']:.3f} |")
    lines.append("")
    lines.append("Per question type (accuracy what / where / count / exists):")
    lines.append("")
    lines.append("| method | target | kept | what | where | count | exists | vision KV / episode |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in rows:
        a = r["accuracy"]
        lines.append(f"| {r['method']} | {r['target']:.2f} | {r['kept_fraction']:.3f} | "
                     + " | ".join(f"{a.get(q, float('nan')):.3f}" for q in ("what", "where", "count", "exists"))
                     + f" | {r['kv_bytes_vision'] / 1024:.0f} KiB |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Accuracy vs kept fraction, one line per method (overall and ``what`` questions)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    for m in methods:
        rs = sorted((r for r in result["rows"] if r["method"] == m), key=lambda r: -r["kept_fraction"])
        style = "-" if m.startswith("lightkv") else "--"
        for ax, key in zip(axes, ("overall", "what")):
            ys = [r["overall"] if key == "overall" else r["accuracy"]["what"] for r in rs]
            ax.plot([r["kept_fraction"] for r in rs], ys, style, marker="o", label=m, lw=2 if m == "lightkv" else 1.2)
    for ax, title in zip(axes, ("all questions", "'what is at rXcY' (cell) questions")):
        ax.set_xlabel("kept vision KV fraction (average over layers)")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(title)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    n = result["config"]["episodes"]
    fig.suptitle(f"DigitGrid-VQA, {n} held-out episodes, {result['model']['vision_tokens']} vision tokens, "
                 f"{result['model']['layers']} decoder layers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def provenance_picture(path: Path, model_dir: str | None = None, seed: int = 3, target: float = 0.55,
                       methods: Sequence[str] = ("lightkv", "tome")) -> dict[str, Any]:
    """One held-out ``what`` question about an occupied cell, in ``2 + len(methods)`` panels:
    the image; the prompt relevance ξ lightkv computes at its first stage (the model's own
    vision-query x text-key score); then for each method the final provenance, every
    original patch painted with the mean colour of the group of patches its surviving token
    stands for (the asked cell outlined in red). Returns what was drawn."""
    import random

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from ..digitgrid import data
    from ..digitgrid import evaluate as ev
    from ..digitgrid import model as dg
    from ..graph.layout import TokenKind

    model, _, grid = dg.load(model_dir or dg.BUNDLED_MODEL)
    rng = random.Random(f"provenance:{seed}")
    while True:
        ep = data.make_episode(rng, "heldout", "what", grid)
        if ep.answer != ["none"]:
            break
    patch = model.config.vision_config.patch_size
    side = grid.image_size // patch
    k = grid.cell // patch
    n_img = side * side
    first_vision = 1  # <bos>, then the image tokens
    colours = ep.image.reshape(3, side, patch, side, patch).mean((2, 4)).permute(1, 2, 0)  # [side, side, 3]
    r, c = ep.meta["row"], ep.meta["col"]
    fig, axes = plt.subplots(1, 2 + len(methods), figsize=(3.6 * (2 + len(methods)), 4.0))
    axes[0].imshow(ep.image.permute(1, 2, 0).numpy(), interpolation="nearest")
    axes[0].set_title(f"'{' '.join(ep.question)}' -> {' '.join(ep.answer)}", fontsize=9)
    drawn: dict[str, Any] = {"question": " ".join(ep.question), "answer": " ".join(ep.answer), "methods": {}}

    def outline(ax, scale: int) -> None:
        ax.add_patch(Rectangle((c * k * scale - 0.5, r * k * scale - 0.5), k * scale, k * scale,
                               fill=False, lw=2.5, ec="red"))

    outline(axes[0], patch)
    num_layers = model.config.text_config.num_hidden_layers
    for i, name in enumerate(methods):
        pipe, _ = method_pipeline(name, num_layers, target)
        with pipe.apply(model, record=True) as session:
            got = ev.answer(model, [ep], grid)[0]
            trace = session.last_prefill
        if i == 0:
            rec = trace.stages[0]
            vision = rec.layout.kind[0] == int(TokenKind.VISION)
            xi = rec.relevance[0][vision].float().reshape(side, side)
            axes[1].imshow(xi.numpy(), cmap="magma", interpolation="nearest")
            outline(axes[1], 1)
            share = float(xi[r * k:(r + 1) * k, c * k:(c + 1) * k].sum() / xi.sum())
            axes[1].set_title(f"{name} relevance ξ after layer {rec.layer}\n"
                              f"{share:.0%} of it on the asked cell (area {1 / grid.grid ** 2:.0%})", fontsize=9)
            drawn["relevance_share_asked"] = share
        owner = trace.provenance.owner[0, first_vision:first_vision + n_img]
        groups = torch.unique(owner, return_inverse=True)[1]
        sums = torch.zeros(int(groups.max()) + 1, 3).index_add_(0, groups, colours.reshape(-1, 3))
        sizes = torch.bincount(groups).unsqueeze(1)
        painted = (sums / sizes)[groups].reshape(side, side, 3)
        ax = axes[2 + i]
        ax.imshow(painted.clamp(0, 1).numpy(), interpolation="nearest")
        # group borders
        g2 = groups.reshape(side, side)
        for y in range(side):
            for x in range(side):
                if x + 1 < side and g2[y, x] != g2[y, x + 1]:
                    ax.plot([x + 0.5, x + 0.5], [y - 0.5, y + 0.5], color="white", lw=0.4)
                if y + 1 < side and g2[y, x] != g2[y + 1, x]:
                    ax.plot([x - 0.5, x + 0.5], [y + 0.5, y + 0.5], color="white", lw=0.4)
        outline(ax, 1)
        asked = g2[r * k:(r + 1) * k, c * k:(c + 1) * k]
        left = int(groups.max()) + 1
        kept = session.report().kept_vision_fraction
        ax.set_title(f"{name} at {kept:.0%} kept: '{' '.join(got)}'\n"
                     f"{left} tokens left; the asked cell's 16 -> {len(torch.unique(asked))}", fontsize=9)
        drawn["methods"][name] = {"answer": " ".join(got), "tokens_left": left,
                                  "asked_cell_tokens": len(torch.unique(asked))}
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def write_outputs(result: dict[str, Any], out: Path, model_dir: str | None = None) -> list[Path]:
    """JSON, Markdown, the accuracy plot and the provenance picture under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "quality.json", out / "quality.md", out / "quality.png", out / "quality-provenance.png"]
    result = dict(result)
    result["provenance_example"] = provenance_picture(paths[3], model_dir)
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown_table(result))
    plot(result, paths[2])
    return paths
