"""The efficiency benchmark's bar charts: ratios per model and preset, the compression
overhead's parts and, at kept-fraction budgets, TTFT against FLOPs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lightkv_lab import vis

__all__ = ["plots"]


def plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Bar charts (PNG); returns the files written, or [] without matplotlib."""
    try:
        plt = vis.pyplot()
    except ImportError:
        print(
            "matplotlib is not installed: skipping plots (pip install matplotlib)",
            file=sys.stderr,
        )
        return []
    rows = result["summary"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    by = {(r["model"], r["preset"]): r for r in rows}
    written = []
    metrics = [
        ("ttft_ratio", "TTFT"),
        ("vision_kv_ratio", "vision KV bytes"),
        ("kv_ratio", "total KV bytes"),
        ("flops_ratio", "prefill FLOPs (analytic)"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6), sharey=True)
    width = 0.8 / max(1, len(presets))
    for ax, (key, title) in zip(axes, metrics):
        for j, p in enumerate(presets):
            vals = [by.get((m, p), {}).get(key) or 0 for m in models]
            ax.bar([i + j * width for i in range(len(models))], vals, width, label=p)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(
            [i + width * (len(presets) - 1) / 2 for i in range(len(models))], models, rotation=20
        )
        ax.set_title(title + " (preset / uncompressed)", fontsize=9)
    axes[0].set_ylabel("ratio")
    axes[0].legend(fontsize=8)
    written.append(vis.save_figure(fig, out_dir / "efficiency-ratios.png"))

    parts = ["layout", "relevance", "stage", "bookkeeping"]
    labels, stacks = [], {k: [] for k in parts}
    for name, m in result["models"].items():
        for p, rec in m["variants"].items():
            if "overhead_share_parts" in rec:
                labels.append(f"{name}\n{p}")
                for k in parts:
                    stacks[k].append(100 * rec["overhead_share_parts"].get(k, 0.0))
    if (
        0 < len(labels) <= 24
    ):  # past that (e.g. every preset at several budgets) the table says it better
        fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(labels)), 3.6))
        bottom = [0.0] * len(labels)
        for k in parts:
            ax.bar(range(len(labels)), stacks[k], bottom=bottom, label=k)
            bottom = [b + v for b, v in zip(bottom, stacks[k])]
        ax.axhline(3.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("% of compressed prefill")
        ax.set_title("compression overhead breakdown", fontsize=9)
        ax.legend(fontsize=8)
        written.append(vis.save_figure(fig, out_dir / "efficiency-overhead.png"))
    budgets = _budget_plot(plt, rows)
    if budgets is not None:
        written.append(vis.save_figure(budgets, out_dir / "efficiency-budgets.png"))
    return written


def _budget_plot(plt, rows: list[dict[str, Any]]):
    """TTFT ratio against FLOPs ratio, one panel per kept-fraction budget (variants named
    ``preset@target``; a colour per preset, a marker per model); the diagonal is the limit
    that time which follows the FLOPs reaches."""
    rows = [r for r in rows if "@" in r["preset"]]
    if not rows:
        return None
    targets = sorted({r["preset"].split("@")[1] for r in rows}, key=float, reverse=True)
    presets = list(dict.fromkeys(r["preset"].split("@")[0] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    colours, markers = plt.get_cmap("tab20").colors, "osD^v<>ph*"
    fig, axes = plt.subplots(
        1,
        len(targets) + 1,
        figsize=(4.2 * len(targets) + 2.2, 4.0),
        squeeze=False,
        gridspec_kw={"width_ratios": [1] * len(targets) + [0.5]},
    )
    for ax, t in zip(axes[0], targets):
        here = [r for r in rows if r["preset"].split("@")[1] == t]
        for r in here:
            p = presets.index(r["preset"].split("@")[0])
            ax.scatter(
                r["flops_ratio"],
                r["ttft_ratio"],
                s=22,
                color=colours[p % len(colours)],
                marker=markers[models.index(r["model"]) % len(markers)],
            )
        top = max(1.0, *(max(r["flops_ratio"], r["ttft_ratio"]) for r in here))
        ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--")
        ax.set_xlabel("prefill FLOPs ratio")
        ax.set_title(f"{float(t):.0%} of the vision KV kept", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TTFT ratio (preset / uncompressed)")
    key = axes[0][-1]
    key.axis("off")
    handles = [
        plt.Line2D([], [], ls="", marker="o", color=colours[i % len(colours)], label=p)
        for i, p in enumerate(presets)
    ]
    handles += [
        plt.Line2D([], [], ls="", marker=markers[i % len(markers)], color="black", label=m)
        for i, m in enumerate(models)
    ]
    key.legend(handles=handles, loc="center left", fontsize=7, frameon=False)
    return fig
