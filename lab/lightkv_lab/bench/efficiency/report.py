"""The efficiency benchmark's outputs: summary rows, the issue's targets, the Markdown
table, bar charts and the files (``efficiency.json``, ``efficiency.md``, PNGs)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from lightkv.outputs import write_atomic
from lightkv_lab import vis
from lightkv_lab.bench.efficiency.shapes import UNCOMPRESSED

__all__ = ["check_targets", "markdown_table", "plots", "summary_rows", "write_outputs"]


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One flat record per model and preset (the docs table)."""
    rows = []
    for name, m in result["models"].items():
        unc = m["variants"][UNCOMPRESSED]
        for variant, rec in m["variants"].items():
            if variant == UNCOMPRESSED:
                continue
            r = rec["ratios"]
            rows.append(
                {
                    "model": name,
                    "preset": variant,
                    "vision_tokens": m["vision_tokens"],
                    "kept_vision": rec.get("kept_vision_fraction"),
                    "kept_vision_ref_depth": rec.get("kept_vision_fraction_reference_depth"),
                    "vision_kv_ratio": r.get("kv_bytes_vision"),
                    "kv_ratio": r["kv_bytes"],
                    "flops_ratio": r["flops"],
                    "flops_ratio_ref_shape": rec.get("flops_ratio_reference_shape"),
                    "ttft_ratio": r["ttft"],
                    "ttft_ms": rec["ttft_ms_median"],
                    "ttft_ms_uncompressed": unc["ttft_ms_median"],
                    "peak_mem_ratio": r.get("peak_memory"),
                    "overhead_share": rec.get("overhead_share"),
                    "overhead_share_ref_est": rec.get("overhead_share_reference_estimate"),
                }
            )
    return rows


def check_targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, checked on what was measured (None where not measured)."""
    models = result["models"]
    out: dict[str, Any] = {}
    kept = {
        n: m["variants"]["lightkv"].get("kept_vision_fraction_reference_depth")
        for n, m in models.items()
        if "lightkv" in m["variants"] and m["reference_decoder"]["layers"] == 32
    }
    out["lightkv_vision_kv_le_60pct_at_32_layers"] = (
        all(v is not None and v <= 0.60 for v in kept.values()) if kept else None
    )
    out["lightkv_vision_kv_at_32_layers"] = kept
    gaps = {
        f"{n}/{v}": rec["ttft_minus_flops_pp"]
        for n, m in models.items()
        for v, rec in m["variants"].items()
        if v != UNCOMPRESSED
    }
    out["ttft_within_5pp_of_flops"] = all(abs(g) <= 5 for g in gaps.values()) if gaps else None
    out["ttft_minus_flops_pp"] = gaps
    nxt = models.get("llava_next", {}).get("variants", {}).get("lightkv", {})
    out["overhead_le_3pct_llava_next"] = (
        nxt["overhead_share"] <= 0.03 if "overhead_share" in nxt else None
    )
    out["overhead_share_llava_next"] = nxt.get("overhead_share")
    est = nxt.get("overhead_share_reference_estimate")
    out["overhead_le_3pct_llava_next_reference_estimate"] = est <= 0.03 if est is not None else None
    out["overhead_share_llava_next_reference_estimate"] = est
    # issue 17: at full width, lightkv's overhead <= 1.5% of prefill and <= 1.5x tome's, its TTFT
    # ratio within 2 points of its FLOPs ratio; at reduced width, overhead <= 2x tome's
    full = result["config"].get("width") == "full"
    vs_tome = {
        n: m["variants"]["lightkv"]["overhead_share"] / m["variants"]["tome"]["overhead_share"]
        for n, m in models.items()
        if {"lightkv", "tome"} <= set(m["variants"]) and m["variants"]["tome"].get("overhead_share")
    }
    out["lightkv_overhead_vs_tome"] = vs_tome
    out["lightkv_overhead_le_2x_tome"] = (
        all(v <= 2 for v in vs_tome.values()) if vs_tome and not full else None
    )
    if full:
        share = nxt.get("overhead_share")
        out["full_width_overhead_le_1_5pct_llava_next"] = (
            share <= 0.015 if share is not None else None
        )
        out["full_width_overhead_le_1_5x_tome_llava_next"] = (
            vs_tome["llava_next"] <= 1.5 if "llava_next" in vs_tome else None
        )
        gap = gaps.get("llava_next/lightkv")
        out["full_width_lightkv_ttft_within_2pp_of_flops_llava_next"] = (
            abs(gap) <= 2 if gap is not None else None
        )
    out.update(budget_targets(result))
    peaks = {
        n: m["variants"]["lightkv"].get("ratios", {}).get("peak_memory")
        for n, m in models.items()
        if "lightkv" in m["variants"]
    }
    peaks = {k: v for k, v in peaks.items() if v is not None}
    out["lightkv_peak_le_uncompressed"] = all(v <= 1.0 for v in peaks.values()) if peaks else None
    out["lightkv_peak_ratio"] = peaks
    spikes = {
        n: m["eager_reference"].get("peak_ratio_vs_uncompressed")
        for n, m in models.items()
        if "eager_reference" in m
        and m["eager_reference"].get("peak_ratio_vs_uncompressed") is not None
    }
    out["eager_reference_spike_above_uncompressed"] = (
        any(v > 1.0 for v in spikes.values()) if spikes else None
    )
    out["eager_reference_peak_ratio"] = spikes
    return out


LIGHTKV_PLACEMENTS = (
    ("lightkv", ("scaled",)),
    ("lightkv-first-layer", ("scaled",)),
    ("lightkv-low-budget", ("before the LLM",)),
    ("lightkv", ("extra stages",)),
)
"""Where LightKV can sit at a budget, in order, with the placements (`lightkv_lab.bench.budgets`)
that count: its own stages (relevance read from the merge layers' own projections); one
merge after layer 0 (the same relevance, but layer 0 keeps every token); one merge before the
LLM (layer 0's query of every token projected once more); its own schedule with a stage
after every layer (a relevance pass and a merge per layer: measured 2% of a 16-layer
prefill against 0.6% for the merge after layer 0)."""


def lightkv_at(variants: dict[str, Any], target: str) -> str | None:
    """The variant that is LightKV at ``target`` (``"0.22"``): the first of
    `LIGHTKV_PLACEMENTS` that was run at ``target`` with a placement that counts; None when
    none was. The order is fixed in advance, not chosen by what was measured."""
    for preset, placements in LIGHTKV_PLACEMENTS:
        v = variants.get(f"{preset}@{target}")
        if v is not None and v.get("placement") in placements:
            return f"{preset}@{target}"
    return None


def budget_targets(result: dict[str, Any]) -> dict[str, Any]:
    """Issue 28's targets of a ``--kept-fractions`` run at full width: LightKV's TTFT ratio
    within 1 point of its FLOPs ratio (and, one-sided, at most 1 point above it) and its
    overhead <= 1% of the prefill at every budget, per model (None where not measured)."""
    out: dict[str, Any] = {}
    targets = sorted(
        {v.split("@")[1] for m in result["models"].values() for v in m["variants"] if "@" in v},
        key=float,
        reverse=True,
    )
    if not targets or result["config"].get("width") != "full":
        return out
    rows, missing = {}, []
    for name, m in result["models"].items():
        for t in targets:
            v = lightkv_at(m["variants"], t)
            if v is None:  # not run, or its schedule stopped short: the budget is not measured
                missing.append(f"{name}@{t}")
                continue
            rec = m["variants"][v]
            rows[f"{name}@{t}"] = {
                "variant": v,
                "ttft_minus_flops_pp": rec["ttft_minus_flops_pp"],
                "overhead_share": rec.get("overhead_share"),
            }
    out["budgets_lightkv"] = rows
    out["budgets_lightkv_not_measured"] = missing
    # no verdict while a budget is missing: one over the measured ones would pass it unseen
    judged = [] if missing else list(rows.values())
    gaps = [r["ttft_minus_flops_pp"] for r in judged]
    out["budgets_lightkv_ttft_within_1pp_of_flops"] = (
        all(abs(g) <= 1 for g in gaps) if gaps else None
    )
    # the field's complaint is a saving that does not show in time: TTFT *above* FLOPs
    out["budgets_lightkv_ttft_at_most_1pp_above_flops"] = (
        all(g <= 1 for g in gaps) if gaps else None
    )
    shares = [r["overhead_share"] for r in judged]
    out["budgets_lightkv_overhead_le_1pct"] = (
        all(s <= 0.01 for s in shares) if shares and None not in shares else None
    )
    return out


def budget_table(result: dict[str, Any]) -> list[str]:
    """Markdown lines: per preset and budget, TTFT minus FLOPs ratio (points; the spread
    of the rounds' own ratios in brackets) and the overhead share; empty without budgets."""
    lines = []
    for name, m in result["models"].items():
        at = [v for v in m["variants"] if "@" in v]
        targets = sorted({v.split("@")[1] for v in at}, key=float, reverse=True)
        if not targets:
            continue
        presets = list(dict.fromkeys(v.split("@")[0] for v in at))
        head = " | ".join(f"{float(t):.0%}: TTFT - FLOPs (rounds) | overhead" for t in targets)
        lines += [
            "",
            f"{name}: TTFT ratio minus FLOPs ratio in points (each round's own ratio in brackets) and "
            "overhead, per budget:",
            "",
            f"| preset | {head} |",
            "|---|" + "---:|---:|" * len(targets),
        ]
        for p in presets:
            cells = []
            for t in targets:
                rec = m["variants"].get(f"{p}@{t}")
                if rec is None:
                    cells += ["n/a", "n/a"]
                    continue
                flops = rec["ratios"]["flops"]
                rounds = ", ".join(
                    f"{100 * (r - flops):+.1f}" for r in rec.get("ttft_ratio_rounds", [])
                )
                where = " (min)" if rec.get("placement") == "min" else ""
                cells += [
                    f"{rec['ttft_minus_flops_pp']:+.1f} ({rounds}){where}",
                    _f(rec.get("overhead_share"), "{:.1%}"),
                ]
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    if lines:
        lines += [
            "",
            "*(min)*: the preset's schedule cannot reach that budget on this depth; it runs at the "
            "least it can keep (see *vision KV*).",
        ]
    return lines


# ---------------------------------------------------------------------------- outputs
def command_line(config: dict[str, Any]) -> str:
    """The ``lightkv bench efficiency`` command that runs ``config`` (a `BenchConfig` as a
    dict): its flags for every field that differs from the default."""
    from dataclasses import asdict

    from lightkv_lab.bench.efficiency.shapes import BenchConfig, quick_config

    base = asdict(quick_config() if config.get("quick") else BenchConfig())
    parts = ["lightkv bench efficiency"] + (["--quick"] if config.get("quick") else [])
    flags = {
        "models": "--models",
        "presets": "--presets",
        "budgets": "--kept-fractions",
        "layers": "--layers",
        "heads": "--heads",
        "width": "--width",
        "repeats": "--repeats",
        "device": "--device",
        "dtype": "--dtype",
        "threads": "--threads",
        "attn_implementation": "--attn-implementation",
        "allocator": "--allocator",
    }
    for key, flag in flags.items():
        v, d = config.get(key), base.get(key)
        many = isinstance(v, (list, tuple))
        if v is None or (list(v) == list(d or []) if many else v == d):
            continue
        parts.append(f"{flag} {' '.join(map(str, v))}" if many else f"{flag} {v}")
    for key, flag, default in [
        ("projection_baseline", "--projection-baseline", False),
        ("memory", "--no-memory", True),
        ("eager_reference", "--no-eager-reference", True),
    ]:
        if config.get(key, default) != default:
            parts.append(flag)
    return " ".join(parts)


def _f(v, fmt="{:.3f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def markdown_table(result: dict[str, Any]) -> str:
    """The summary as Markdown (ratios are compressed / uncompressed)."""
    dev = result["machine"]["device"]
    lines = [
        (
            f"Measured on {dev} ({result['machine']['device_name'] or 'unknown'}, {result['machine']['threads']} threads, "
            f"{result['machine'].get('allocator', 'system')} host allocator), "
            f"torch {result['machine']['torch']}. Ratios are preset / uncompressed; TTFT is the median of "
            f"{result['config']['repeats']} prefills after {result['config']['warmup']} warm-up(s)."
        ),
        "",
        f"Command: `{command_line(result['config'])}`",
        "",
        f"*Decoders:* {result['reductions']}",
        "",
        (
            "| model | preset | vision tokens | vision KV (reduced) | vision KV (ref. depth) | KV total | FLOPs | "
            "FLOPs (ref. shape) | TTFT | TTFT ms (uncompr.) | peak mem | overhead | overhead (7B est.) |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["summary"]:
        lines.append(
            f"| {r['model']} | {r['preset']} | {r['vision_tokens']:,} | {_f(r['vision_kv_ratio'])} | "
            f"{_f(r['kept_vision_ref_depth'])} | {_f(r['kv_ratio'])} | {_f(r['flops_ratio'])} | "
            f"{_f(r['flops_ratio_ref_shape'])} | {_f(r['ttft_ratio'])} | "
            f"{_f(r['ttft_ms'], '{:.0f}')} ({_f(r['ttft_ms_uncompressed'], '{:.0f}')}) | "
            f"{_f(r['peak_mem_ratio'])} | {_f(r['overhead_share'], '{:.1%}')} | "
            f"{_f(r['overhead_share_ref_est'], '{:.1%}')} |"
        )
    lines += budget_table(result)
    refused = [
        (n, v, why) for n, m in result["models"].items() for v, why in m.get("refused", {}).items()
    ]
    if refused:
        lines += ["", "Not run (refused by the family's adapter):", ""]
        lines += [f"- {n} / {v}: {why}" for n, v, why in refused]
    ran = {
        n: sorted(
            {k for v in m["variants"].values() for k in v.get("attention", {}).get("ran", {})}
        )
        for n, m in result["models"].items()
    }
    if any(ran.values()):  # checked equal across variants by the run (`runner.check_attention`)
        lines += [
            "",
            "Attention that ran, every variant alike: "
            + "; ".join(f"{n}: {', '.join(r)}" for n, r in ran.items() if r)
            + ".",
        ]
    eager = [
        (n, m["eager_reference"]) for n, m in result["models"].items() if "eager_reference" in m
    ]
    if eager:
        lines += [
            "",
            "Reference-style relevance (full `H x N x N` attention at each merge layer) vs ours (`N x T`, sdpa):",
            "",
            (
                "| model | reference scoring ms | our relevance ms | time ratio | H x N x N bytes (reduced / 7B) | "
                "peak: lightkv | peak: + reference scoring | vs uncompressed |"
            ),
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for n, e in eager:
            lines.append(
                f"| {n} | {_f(e.get('reference_scoring_ms'), '{:.1f}')} | {_f(e.get('lightkv_relevance_ms'), '{:.1f}')} | "
                f"{_f(e.get('time_ratio'), '{:.1f}x')} | {_mib(e.get('matrix_bytes'))} / "
                f"{_mib(e.get('matrix_bytes_reference_decoder'))} | {_mib(e.get('peak_bytes_lightkv'))} | "
                f"{_mib(e.get('peak_bytes_with_reference_scoring'))} | {_f(e.get('peak_ratio_vs_uncompressed'))} |"
            )
    ref = result["lightkv_reference_schedule"]
    lines += [
        "",
        (
            f"LightKV's reference schedule (layers {ref['layers_of_32']} of 32, 4/2/1 windows, half per stage) keeps "
            f"{ref['kept_vision_fraction_analytic']:.1%} of the vision KV analytically. *vision KV (ref. depth)* and "
            "*FLOPs (ref. shape)* apply each preset's unscaled schedule and this run's per-stage token counts to the "
            "full-size decoder. *overhead*: the compression's own hooks (layout, relevance, graph + merge, masks) as a "
            "share of the compressed prefill; *overhead (7B est.)* rescales it to the full-size decoder at this "
            "machine's FLOP rate (relevance x width ratio^2, stage x width ratio)."
        ),
        "",
        # the project's own acceptance flags (ttft_within_5pp_of_flops, ...) are for its CI and docs, not
        # for a reader of this table: they stay in the JSON
        "The project's acceptance checks of this run are in efficiency.json (`targets`).",
    ]
    return "\n".join(lines) + "\n"


def _mib(v) -> str:
    return "n/a" if v is None else f"{v / 2**20:,.1f} MiB"


def plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Bar charts (PNG); returns the files written, or [] without matplotlib."""
    try:
        plt = vis.pyplot()
    except ImportError:
        print(
            "matplotlib is not installed: skipping plots (pip install 'lightkv-lab')",
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


def write_outputs(result: dict[str, Any], out_dir: Path, with_plots: bool = True) -> list[Path]:
    """``efficiency.json``, ``efficiency.md`` and the PNGs in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / "efficiency.json", out_dir / "efficiency.md"]
    for path, text in zip(
        files, [json.dumps(_jsonable(result), indent=2) + "\n", markdown_table(result)]
    ):
        write_atomic(path, text)  # both rendered before either is written
    if with_plots:
        files += plots(result, out_dir)
    return files


def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return None
    return v
