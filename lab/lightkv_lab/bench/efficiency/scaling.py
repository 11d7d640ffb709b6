"""How the compression's cost grows with the number of vision tokens.

Two measurements over square images of ``side x side`` vision tokens (default sides 24, 32,
54, 85: 576, 1,024, 2,916 and 7,225 tokens, the LLaVA-1.5, Qwen2.5-VL, LLaVA-NeXT and
LLaVA-OneVision counts to within 1%):

* **stage**: the pure `lightkv.Stage` chain of the LightKV preset (three stages, each on the
  previous one's output) on random ``[1, N, width]`` hidden states (default width 4096),
  with the preset's windows per side (4, 2, 1: the last stage is one global window, so its
  bipartite similarity is quadratic in tokens) and with *fixed* 8x8-token windows (the
  window count grows with the image: the graph work must be linear);
* **prefill**: the whole prefill of a LLaVA-shaped random model (reduced decoder, see
  `lightkv_lab.bench.efficiency.shapes`) uncompressed and with LightKV, with the session's own
  work (`OverheadProbe`) split out.

`fit_exponent` fits ``t = c N^k`` by least squares in log-log space; the report states ``k``
for every curve. Run with ``lightkv bench scaling``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

__all__ = [
    "ScalingConfig",
    "fit_exponent",
    "prefill_scaling",
    "quick_scaling",
    "run_scaling",
    "scaling_markdown",
    "scaling_plot",
    "stage_scaling",
    "write_scaling",
]

TEXT_BEFORE, TEXT_AFTER = 20, 15


@dataclass
class ScalingConfig:
    """What `run_scaling` measures.

    Attributes:
        sides: image sides in tokens (``side^2`` vision tokens each).
        width: hidden width of the stage measurement.
        window: the fixed window size (tokens per side) of the linear variant.
        heads, layers: the prefill measurement's decoder (width ``heads x 128``).
        repeats: timed runs per point (median), after one warm-up.
        prefill: also measure whole prefills (slower).
        threads: torch CPU threads (None: torch's default).
    """

    sides: tuple[int, ...] = (24, 32, 54, 85)
    width: int = 4096
    window: int = 8
    heads: int = 4
    layers: int = 8
    repeats: int = 3
    prefill: bool = True
    threads: int | None = None

    def __post_init__(self) -> None:
        self.sides = tuple(int(s) for s in self.sides)
        if len(self.sides) < 2 or min(self.sides) < 2:
            raise ValueError(f"give at least two image sides >= 2 tokens, got {self.sides}")
        if self.repeats < 1 or self.width < 1 or self.window < 1:
            raise ValueError("repeats, width and window must be >= 1")


def fit_exponent(ns, ts) -> float:
    """The least-squares slope ``k`` of ``log t = k log N + c``."""
    xs, ys = [math.log(n) for n in ns], [math.log(t) for t in ts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def _stage_chain(pipe, num_layers: int):
    stages = pipe.stages(num_layers)

    def run(hidden, layout, relevance):
        prov, xi = None, relevance
        for stage in stages:
            out = stage(hidden, layout, xi, prov)
            hidden, layout, prov = out.hidden, out.layout, out.provenance
            xi = relevance.gather(1, layout.origin.clamp_min(0))  # the survivors' ξ (random here)
        return hidden

    return run


def stage_scaling(cfg: ScalingConfig) -> dict[str, Any]:
    """Median ms of the LightKV preset's three-stage chain per image side, with the
    preset's windows per side and with fixed ``cfg.window``-token windows."""
    from lightkv import ImageSegment, VisionLayout
    from lightkv.policies import ExplicitSchedule
    from lightkv.presets import get_preset

    pipe = get_preset("lightkv")
    sched = pipe.scheduler
    fixed = pipe.with_scheduler(
        ExplicitSchedule(
            layers=sched.layers,
            removal_ratios=sched.removal_ratios,
            windows_per_side=None,
            window_size=((cfg.window, cfg.window),),
        )
    )
    variants = {
        "preset windows (4, 2, 1 per side)": _stage_chain(pipe, 32),
        f"fixed {cfg.window}x{cfg.window}-token windows": _stage_chain(fixed, 32),
    }
    gen = torch.Generator().manual_seed(0)
    points = []
    with torch.inference_mode():
        for side in cfg.sides:
            n = TEXT_BEFORE + side * side + TEXT_AFTER
            layout = VisionLayout.from_segments(1, n, [ImageSegment(0, TEXT_BEFORE, (side, side))])
            hidden = torch.randn(1, n, cfg.width, generator=gen)
            relevance = torch.rand(1, n, generator=gen)
            row = {"side": side, "vision_tokens": side * side}
            for name, chain in variants.items():
                row[name] = _median_ms(
                    lambda chain=chain, h=hidden, lo=layout, r=relevance: chain(h, lo, r),
                    cfg.repeats,
                )
            points.append(row)
    ns = [p["vision_tokens"] for p in points]
    return {
        "points": points,
        "exponents": {name: fit_exponent(ns, [p[name] for p in points]) for name in variants},
    }


def prefill_scaling(cfg: ScalingConfig) -> dict[str, Any]:
    """Uncompressed and LightKV prefill (ms, median) of a LLaVA-shaped model per image
    side, and the session's own work by part (`OverheadProbe`), variants interleaved."""
    from lightkv.adapters import apply
    from lightkv_lab.bench.efficiency.measure import OverheadProbe, first_token
    from lightkv_lab.bench.efficiency.shapes import MODELS, scaled_pipeline
    from lightkv_lab.tiny import TINY_MODELS

    spec = MODELS["llava"]
    sizes = spec.reduced(cfg.layers, cfg.heads)
    pipe = scaled_pipeline("lightkv", spec, cfg.layers)
    fam = TINY_MODELS["llava"]
    points = []
    for side in cfg.sides:
        torch.manual_seed(0)
        model = fam.build(
            num_layers=cfg.layers,
            hidden_size=sizes["hidden"],
            intermediate_size=sizes["intermediate"],
            num_heads=sizes["heads"],
            num_kv_heads=sizes["kv_heads"],
            image_size=2 * side,
            patch_size=2,
        )
        inputs = fam.collate([fam.row(model, 1, pre=TEXT_BEFORE, post=TEXT_AFTER, seed=0)])
        times = {"uncompressed": [], "lightkv": []}
        parts: list[dict[str, float]] = []
        with torch.no_grad():
            for i in range(cfg.repeats + 1):
                t0 = time.perf_counter()
                first_token(model, inputs)
                unc = time.perf_counter() - t0
                with apply(pipe, model) as session:
                    probe = OverheadProbe(session, lambda: None)
                    t0 = time.perf_counter()
                    first_token(model, inputs)
                    comp = time.perf_counter() - t0
                    probe.close()
                if i:  # the first round warms up
                    times["uncompressed"].append(1000 * unc)
                    times["lightkv"].append(1000 * comp)
                    parts.append({k: 1000 * v for k, v in probe.totals.items()})
        row = {
            "side": side,
            "vision_tokens": side * side,
            "prompt_tokens": int(inputs["input_ids"].shape[1]),
        }
        row.update({f"{k}_ms": statistics.median(v) for k, v in times.items()})
        row.update({f"{k}_ms": statistics.median(p[k] for p in parts) for k in parts[0]})
        row["overhead_share"] = sum(row[f"{k}_ms"] for k in parts[0]) / row["lightkv_ms"]
        points.append(row)
        model = None
    ns = [p["vision_tokens"] for p in points]
    keys = ["uncompressed_ms", "lightkv_ms", "stage_ms", "relevance_ms"]
    return {
        "decoder": dict(sizes, head_dim=128),
        "points": points,
        "exponents": {k: fit_exponent(ns, [max(p[k], 1e-6) for p in points]) for k in keys},
    }


def run_scaling(cfg: ScalingConfig | None = None) -> dict[str, Any]:
    """Both measurements; a JSON-serialisable dict."""
    import platform

    cfg = cfg or ScalingConfig()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    out: dict[str, Any] = {
        "config": asdict(cfg),
        "machine": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
        },
    }
    out["stage"] = stage_scaling(cfg)
    if cfg.prefill:
        out["prefill"] = prefill_scaling(cfg)
    out["seconds"] = time.perf_counter() - t0
    return out


def quick_scaling(**over: Any) -> ScalingConfig:
    """A short run: small sides, narrow stage, one repeat."""
    return replace(ScalingConfig(sides=(8, 12, 16), width=64, heads=1, layers=6, repeats=1), **over)


# ---------------------------------------------------------------------------- outputs
def scaling_markdown(result: dict[str, Any]) -> str:
    """The measurements as Markdown tables, with the fitted exponents."""
    st = result["stage"]
    names = list(st["exponents"])
    cfg = result["config"]
    lines = [
        f"Stage chain of the `lightkv` preset (3 stages) on random `[1, N, {cfg['width']}]` hidden "
        f"states, median of {cfg['repeats']} runs, {result['machine']['threads']} threads:",
        "",
        "| vision tokens | " + " | ".join(f"{n} (ms)" for n in names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for p in st["points"]:
        lines.append(
            f"| {p['vision_tokens']:,} | " + " | ".join(f"{p[n]:.1f}" for n in names) + " |"
        )
    lines.append(
        "| **fitted exponent k** (t ~ N^k) | "
        + " | ".join(f"**{st['exponents'][n]:.2f}**" for n in names)
        + " |"
    )
    pf = result.get("prefill")
    if pf:
        d = pf["decoder"]
        lines += [
            "",
            f"Whole prefill, LLaVA-shaped random model ({d['layers']} layers, width {d['hidden']}, "
            f"MLP {d['intermediate']}), uncompressed vs `lightkv` (schedule scaled to the depth):",
            "",
            "| vision tokens | uncompressed ms | lightkv ms | ratio | stage ms | relevance ms | "
            "overhead |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in pf["points"]:
            lines.append(
                f"| {p['vision_tokens']:,} | {p['uncompressed_ms']:.0f} | {p['lightkv_ms']:.0f} | "
                f"{p['lightkv_ms'] / p['uncompressed_ms']:.3f} | {p['stage_ms']:.1f} | "
                f"{p['relevance_ms']:.1f} | {p['overhead_share']:.1%} |"
            )
        e = pf["exponents"]
        lines.append(
            f"| **fitted exponent k** | **{e['uncompressed_ms']:.2f}** | **{e['lightkv_ms']:.2f}** "
            f"| | **{e['stage_ms']:.2f}** | **{e['relevance_ms']:.2f}** | |"
        )
    return "\n".join(lines) + "\n"


def scaling_plot(result: dict[str, Any], path) -> Any:
    """One log-log plot of every curve, exponents in the legend; None without matplotlib."""
    from lightkv_lab import vis

    try:
        plt = vis.pyplot()
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    st = result["stage"]
    ns = [p["vision_tokens"] for p in st["points"]]
    for name, k in st["exponents"].items():
        ax.plot(ns, [p[name] for p in st["points"]], "o-", label=f"stage chain, {name} (k={k:.2f})")
    pf = result.get("prefill")
    if pf:
        ns2 = [p["vision_tokens"] for p in pf["points"]]
        for key, label, style in [
            ("uncompressed_ms", "prefill, uncompressed", "s--"),
            ("lightkv_ms", "prefill, lightkv", "s-"),
            ("stage_ms", "in-model stages", "^:"),
            ("relevance_ms", "in-model relevance", "v:"),
        ]:
            ax.plot(
                ns2,
                [p[key] for p in pf["points"]],
                style,
                label=f"{label} (k={pf['exponents'][key]:.2f})",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("vision tokens")
    ax.set_ylabel("ms (median)")
    ax.set_title("cost vs vision tokens", fontsize=9)
    ax.legend(fontsize=7)
    return vis.save_figure(fig, path)


def write_scaling(result: dict[str, Any], out_dir, with_plots: bool = True) -> list:
    """``scaling.json``, ``scaling.md`` and ``efficiency-scaling.png`` in ``out_dir``."""
    import json
    from pathlib import Path

    from lightkv.outputs import write_atomic

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "scaling.json", out_dir / "scaling.md"]
    for path, text in zip(files, [json.dumps(result, indent=2) + "\n", scaling_markdown(result)]):
        write_atomic(path, text)  # both rendered before either is written
    if with_plots:
        png = scaling_plot(result, out_dir / "efficiency-scaling.png")
        if png is not None:
            files.append(png)
    return files
