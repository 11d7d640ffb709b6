"""Quality vs kept vision KV on a synthetic LVLM, for every method, with fidelity metrics.

The model is a bundled model (`lightkv_lab.tasks.model.BUNDLED_MODELS`: Scenes, the command
line's default, with natural-image token statistics; DigitGrid, answers in one 4x4-token
cell; SymbolGrid, answers in single vision tokens) or any model directory the trainer
writes. Each
method (preset) runs at several kept-fraction targets, put there by the library's knob
(``lightkv.load(name, kept_fraction=t)``, `lightkv_lab.bench.budgets.knob_pipeline`): its
stages stay where the method runs them (before the LLM, after its own layers, scaled from
32 on a shallower decoder, or on each layer's cache) and their ratios move. Where a method
cannot remove that much there (a merge stage with a parity split removes at most half of its
window; 2x2 pooling at most three quarters; FastV's first two layers keep everything), it runs
at the nearest fraction it can reach (``how: "nearest"``). 100% is the uncompressed model,
shared by all methods.

Every method sees the same held-out conversations in the same batches (a first question,
then a follow-up about another region answered from the cache compressed for the first), scored
teacher-forced (`lightkv_lab.tasks.scoring`): exact match per question type and for the
follow-up, KL(p_uncompressed || p_compressed) per answer token, the drop in log-probability
of the reference answer, and paired bootstrap 95% intervals of the differences to lightkv and
to the uncompressed model. At 55% an ablation table swaps one part of LightKV at a time
(relevance off, random merge partners, l2 instead of cosine). `lightkv_lab.bench.quality_report`
writes ``quality-<model>.json``, ``.md``, ``.png`` (accuracy and KL vs kept fraction) and
``quality-<model>-provenance.png``; it imports this module, never the other way round.

```python
from lightkv_lab.bench.quality import AccuracyConfig, run
result = run(
    AccuracyConfig(
        model="digitgrid",
        episodes=40,
        methods=("lightkv", "fastv"),
        targets=(1.0, 0.55),
        ablations=False,
        relevance_episodes=0,
    )
)
```
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from lightkv_lab.bench.budgets import knob_pipeline
from lightkv_lab.bench.paths import results_dir

__all__ = [
    "ABLATIONS",
    "CACHE_METHODS",
    "METHODS",
    "TARGETS",
    "AccuracyConfig",
    "ablation_pipeline",
    "run",
]

METHODS = (
    "lightkv", "lightkv-cover", "lightkv-cover-no-pa", "lightkv-low-budget", "lightkv-paper",
    "lightkv-no-relevance", "tome", "fastv", "pdrop", "random", "pool", "elasticcache", "h2o",
    "visionzip", "vispruner", "divprune", "cdpruner", "dart", "scope", "mmtok", "holov",
    "vscan", "downsample", "sparsevlm", "prumerge-plus", "trim", "tops", "eadp", "era",
)  # fmt: skip
CACHE_METHODS = ("elasticcache", "h2o")
"""Methods that act on every layer's cache after prefill: at a target ``t`` every layer keeps
``t`` of its vision KV (ElasticCache merges ``1 - t`` of each image's entries, H2O keeps a
budget of ``t`` of each row's vision entries), so the kept fraction averaged over layers is
``t`` as for the others, while the prefill itself is never compressed."""
TARGETS = (1.0, 0.75, 0.55, 0.40, 0.25)
RESULTS = results_dir()


ABLATIONS = {
    "relevance off": {"relevance": ("uniform", {})},
    "relevance last token": {"relevance": ("last_token", {})},
    "relevance question": {"relevance": ("question_attention", {})},
    "random merge": {"scorer": ("random", {})},
    "scorer l2": {"scorer": ("l2", {})},
}
"""LightKV with one part swapped (policy family -> (registered name, parameters)), at
`AccuracyConfig.ablation_targets` (55% by default)."""
ABLATION_TARGET = 0.55


@dataclass(frozen=True)
class AccuracyConfig:
    """What to run."""

    model: str | None = None
    """A bundled model's name (``scenes``) or a model directory (None: ``digitgrid``, the
    first bundled model; the command line defaults to ``scenes``)."""
    episodes: int = 600
    """Held-out conversations (question types in equal shares)."""
    methods: tuple[str, ...] = METHODS
    targets: tuple[float, ...] = TARGETS
    ablations: bool = True
    """Also run `ABLATIONS` at each of ``ablation_targets``."""
    ablation_targets: tuple[float, ...] = (ABLATION_TARGET,)
    followup: bool = True
    """Ask a follow-up question about another region after each first answer."""
    relevance_episodes: int = 64
    """Episodes for the relevance table (``what`` questions on cell tasks, every asked type on
    tasks whose episodes name their asked region) and the redundancy measurement (0: skip)."""
    batch: int = 100
    seed: int = 0
    bootstrap: int = 2000
    threads: int | None = None
    baseline: str | None = None
    """The comparator of the paired intervals (a method of ``methods``); None: the first
    lightkv method given (`comparator`), and no intervals when none is."""


def comparator(config: AccuracyConfig) -> str | None:
    """The method every row's paired intervals are taken against: ``config.baseline``, else
    the first of ``config.methods`` whose name starts with ``lightkv`` (None: there is none).

    Raises:
        ValueError: ``baseline`` is not one of ``methods``.
    """
    if config.baseline is not None:
        if config.baseline not in config.methods:
            raise ValueError(
                f"--baseline {config.baseline} is not among --methods "
                f"({', '.join(config.methods)}): the intervals compare methods of one run"
            )
        return config.baseline
    return next((m for m in config.methods if m.startswith("lightkv")), None)


def ablation_pipeline(name: str, num_layers: int, target: float = ABLATION_TARGET):
    """``(pipeline, how)``: the ``lightkv`` preset at ``target`` with `ABLATIONS` ``[name]`` swapped
    in."""
    from lightkv.policies import EdgeScorer, Relevance

    families = {"scorer": EdgeScorer, "relevance": Relevance}
    pipe, how = knob_pipeline("lightkv", num_layers, target)
    swaps = {
        family: families[family].create(policy, **params)
        for family, (policy, params) in ABLATIONS[name].items()
    }
    return replace(pipe, name=f"lightkv ({name})", **swaps), how


def run(config: AccuracyConfig = AccuracyConfig(), progress: bool = True) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-able result (rows of per-type metrics). With
    ``progress``, a bar on a terminal (`lightkv_lab.bench.progress.Progress`). The frozen
    vision tower runs once per batch of conversations (`lightkv_lab.tasks.tower_memo`)."""
    from lightkv_lab.tasks import model as dg
    from lightkv_lab.tasks.tower_memo import TowerMemo, layers_read_by

    if config.threads:
        torch.set_num_threads(config.threads)
    path = dg.resolve_model(config.model)
    model, _, grid = dg.load(path)
    depth = model.config.text_config.num_hidden_layers
    tapped = [knob_pipeline(m, depth, 0.5)[0] for m in config.methods]
    with TowerMemo(model, keep=layers_read_by(tapped, model)):  # the tower runs once per batch
        return _run(config, progress, model, grid, dg.read_task(path))


def _run(config: AccuracyConfig, progress: bool, model, grid, task) -> dict[str, Any]:
    from lightkv_lab.bench.progress import Progress
    from lightkv_lab.tasks import evaluate as ev
    from lightkv_lab.tasks import scoring as sc

    ref = comparator(config)
    num_layers = model.config.text_config.num_hidden_layers
    convs = sc.conversations(config.episodes, grid, seed=config.seed, followup=config.followup)
    t0 = time.time()
    compressed = [t for t in config.targets if t < 1.0]
    steps = 1 + len(config.methods) * len(compressed) + bool(config.relevance_episodes)
    steps += len(config.ablation_targets) * len(ABLATIONS) if config.ablations else 0
    bar = Progress(steps, f"quality ({task.name})", quiet=not progress)

    def log(msg: str) -> None:
        bar.step(msg)

    base = sc.score(model, convs, grid, None, batch=config.batch)
    log("uncompressed")
    runs: list[tuple[str, float, str, Any, Any]] = []  # method, target, how, schedule, score
    for name in config.methods:
        for target in config.targets:
            if target >= 1.0:
                runs.append((name, 1.0, "scaled", None, base))
                continue
            pipe, how = knob_pipeline(name, num_layers, target)
            res = sc.score(model, convs, grid, pipe, batch=config.batch)
            # a pipeline of a mode alone (h2o) records the mode and its settings instead
            runs.append((name, target, how, pipe.scheduler or pipe.mode, res))
            log(f"{name} at {target:.2f}: kept {res.kept_fraction:.3f}")
    ablations = []
    if config.ablations:
        for target in config.ablation_targets:
            for name in ABLATIONS:
                pipe, how = ablation_pipeline(name, num_layers, target)
                res = sc.score(model, convs, grid, pipe, batch=config.batch)
                ablations.append((pipe.name, target, how, pipe.scheduler, res))
                log(f"{pipe.name} at {target:.2f}: kept {res.kept_fraction:.3f}")
    ref_at = {t: r for m, t, _, _, r in runs if m == ref}
    lightkv_at = {t: r for m, t, _, _, r in runs if m == "lightkv"}
    rows = [
        _row(m, t, how, sched, res, base, ref_at.get(t), config) for m, t, how, sched, res in runs
    ]
    ablation_rows = [
        _row(
            m,
            t,
            how,
            sched,
            res,
            base,
            lightkv_at.get(t) or _lightkv_at(model, convs, grid, config, t),  # vs lightkv
            config,
        )
        for m, t, how, sched, res in ablations
    ]
    relevance = region = redundancy = None
    if config.relevance_episodes and getattr(task.data, "ASKED_REGION", False):
        region, redundancy = _region_measures(model, grid, num_layers, config)
        log("relevance on the asked region")
    elif config.relevance_episodes:
        what = [
            e
            for e in ev.heldout_episodes(
                4 * config.relevance_episodes, seed=config.seed + 1, grid=grid
            )
            if e.qtype == "what"
        ][: config.relevance_episodes]
        relevance = ev.relevance_mass(model, what, grid)
        log("relevance mass on the asked cell")
    bar.close()
    return {
        "benchmark": f"{task.name}-quality",
        "baseline": ref,
        "relevance_mass": relevance,
        "region_relevance": region,
        "redundancy": redundancy,
        "config": asdict(config),
        "model": {
            "name": config.model or "digitgrid",
            "task": task.name,
            "layers": num_layers,
            "vision_tokens": task.data.num_image_tokens(
                grid, model.config.vision_config.patch_size
            ),
        },
        "grid": asdict(grid),
        "qtypes": list(dict.fromkeys(task.asked(grid))),  # each type once
        "detail_qtypes": list(getattr(task.data, "DETAIL_QTYPES", ("what",))),
        "uncompressed": _row("uncompressed", 1.0, "scaled", None, base, base, None, config),
        "rows": rows,
        "ablations": ablation_rows,
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "seconds": time.time() - t0,
    }


def _lightkv_at(model, convs, grid, config, target: float = ABLATION_TARGET):
    from lightkv_lab.tasks import scoring as sc

    pipe, _ = knob_pipeline("lightkv", model.config.text_config.num_hidden_layers, target)
    return sc.score(model, convs, grid, pipe, batch=config.batch)


def first_stage_layer(num_layers: int, target: float = ABLATION_TARGET) -> int:
    """The layer after which lightkv's first stage runs at ``target`` on a model this deep."""
    pipe, _ = knob_pipeline("lightkv", num_layers, target)
    return pipe.plan(num_layers)[0].layer


def _region_measures(model, grid, num_layers: int, config: AccuracyConfig):
    """Relevance on the asked region per policy for the layers up to lightkv's first stage,
    and the near-duplicate share after that layer (tasks whose episodes carry ``region``)."""
    from lightkv_lab.tasks import evaluate as ev
    from lightkv_lab.tasks.scenes.measure import near_duplicates, region_relevance

    first = first_stage_layer(num_layers)
    eps = ev.heldout_episodes(config.relevance_episodes, seed=config.seed + 1, grid=grid)
    region = region_relevance(
        model,
        eps,
        grid,
        layers=range(first + 1),
        policies=(
            "query_softmax",
            "last_token",
            "text_attention",
            "question_attention",
            "tower_attention",
        ),
    )
    region["first_stage_layer"] = first
    return region, near_duplicates(model, eps, grid, first)


def _by_type(res, values: torch.Tensor, followup_values: torch.Tensor | None) -> dict[str, float]:
    out = {}
    for q in dict.fromkeys(res.qtypes):
        sel = torch.tensor([t == q for t in res.qtypes])
        out[q] = float(values[sel].double().nanmean())
    out["overall"] = float(values.double().nanmean())
    if followup_values is not None:
        out["followup"] = float(followup_values.double().nanmean())
    return out


def _intervals(res, x: torch.Tensor, y: torch.Tensor, fx, fy, config) -> dict[str, list[float]]:
    """Paired bootstrap ``[mean(x - y), low, high]`` per question type, overall and follow-up."""
    from lightkv_lab.tasks.scoring import paired_bootstrap

    out = {}
    for q in dict.fromkeys(res.qtypes):
        sel = torch.tensor([t == q for t in res.qtypes])
        out[q] = list(paired_bootstrap(x[sel], y[sel], config.bootstrap, config.seed))
    out["overall"] = list(paired_bootstrap(x, y, config.bootstrap, config.seed))
    if fx is not None and fy is not None:
        out["followup"] = list(paired_bootstrap(fx, fy, config.bootstrap, config.seed))
    return out


def _row(method, target, how, schedule, res, base, ref, config) -> dict[str, Any]:
    """Per-type metrics of one run, with paired intervals vs the uncompressed model and vs
    ``ref`` (the run's comparator at this target, `comparator`; ``vs_baseline``: the
    comparator minus this run; absent for the comparator itself or without one)."""
    from lightkv_lab.tasks.scoring import kl

    fup = res.followup_correct is not None
    kl1 = kl(base, res)
    kl2 = kl(base, res, followup=True) if fup else None
    # log-probability drop of the reference answer, on episodes the uncompressed model gets right
    right = base.correct
    drop = base.logp - res.logp
    row: dict[str, Any] = {
        "method": method,
        "target": target,
        "how": how,
        "schedule": None
        if schedule is None
        else (
            {"layers": list(schedule.layers), "removal_ratios": list(schedule.removal_ratios)}
            if hasattr(schedule, "removal_ratios")
            else {"name": schedule.name, **schedule.params()}
        ),
        "kept_fraction": res.kept_fraction,
        "kv_bytes_vision": res.kv_bytes_vision,
        "kv_bytes_vision_baseline": res.kv_bytes_vision_baseline,
        "accuracy": _by_type(
            res, res.correct.double(), res.followup_correct.double() if fup else None
        ),
        "kl": _by_type(res, kl1, kl2),
        # per type; None where the uncompressed model got no episode of that type right
        "logp_drop": {
            k: (None if math.isnan(v) else v)
            for k, v in _by_type(res, torch.where(right, drop, torch.nan), None).items()
        },
    }
    acc, bacc = res.correct.double(), base.correct.double()
    facc = res.followup_correct.double() if fup else None
    fbacc = base.followup_correct.double() if fup else None
    row["vs_uncompressed"] = {"accuracy": _intervals(res, acc, bacc, facc, fbacc, config)}
    if ref is not None and ref is not res:
        lacc = ref.correct.double()
        flacc = ref.followup_correct.double() if fup else None
        lkl1 = kl(base, ref)
        lkl2 = kl(base, ref, followup=True) if fup else None
        row["vs_baseline"] = {
            "accuracy": _intervals(res, lacc, acc, flacc, facc, config),
            "kl": _intervals(res, lkl1, kl1, lkl2, kl2, config),
        }
    return row
