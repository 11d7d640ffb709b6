"""The prefill-memory benchmark's outputs (`lightkv_lab.bench.efficiency.memory`): the
issue's targets, the Markdown tables, the plot and the files (``prefill-memory.json``,
``prefill-memory.md``, ``prefill-memory.png``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightkv.outputs import write_atomic
from lightkv_lab.bench.efficiency.shapes import UNCOMPRESSED

__all__ = ["MEMORY_LIMIT", "check_targets", "memory_markdown", "memory_plot", "write_memory"]

MEMORY_LIMIT = 0.25e9
"""Bytes a preset's peak may exceed the uncompressed model's by at ~9,600 tokens."""
MEMORY_AT, TIME_AT = 9600, 5600
"""The prompt lengths of the targets (the nearest measured length is used)."""


def _by(result: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(p["variant"], p["length"]): p for p in result["points"]}


def _nearest(result: dict[str, Any], want: int) -> int:
    return min(result["config"]["lengths"], key=lambda n: abs(n - want))


def check_targets(result: dict[str, Any]) -> dict[str, Any]:
    """The targets: at the length nearest 9,600 tokens no preset's peak resident set exceeds
    the uncompressed model's by more than `MEMORY_LIMIT`; at the length nearest 5,600 no
    preset's prefill takes more CPU time than the uncompressed one. Points that failed to run
    are listed apart (``errors``)."""
    by = _by(result)
    presets = [v for v in result["config"]["presets"]]
    out: dict[str, Any] = {}
    for key, want in (("memory", MEMORY_AT), ("time", TIME_AT)):
        n = _nearest(result, want)
        unc = by.get((UNCOMPRESSED, n), {})
        over, errors = {}, {}
        for p in presets:
            rec = by.get((p, n), {})
            if "error" in rec or "error" in unc:
                errors[p] = rec.get("error") or unc.get("error")
                continue
            if key == "memory":
                excess = rec["peak_bytes"] - unc["peak_bytes"]
                if excess > MEMORY_LIMIT:
                    over[p] = excess
            else:
                ratio = rec["cpu_seconds"] / unc["cpu_seconds"]
                if ratio > 1.0:
                    over[p] = ratio
        out[key] = {"length": n, "over": over, "errors": errors, "passed": not over}
    out["memory"]["limit_bytes"] = MEMORY_LIMIT
    return out


def _cell_gb(rec: dict[str, Any] | None, unc: dict[str, Any] | None) -> str:
    if not rec:
        return ""
    if "error" in rec:
        return "error"
    text = f"{rec['peak_bytes'] / 1e9:.2f}"
    if unc and "error" not in unc and rec is not unc:
        text += f" ({(rec['peak_bytes'] - unc['peak_bytes']) / 1e9:+.2f})"
    return text


def _cell_time(rec: dict[str, Any] | None, unc: dict[str, Any] | None) -> str:
    if not rec:
        return ""
    if "error" in rec:
        return "error"
    if rec is unc or not unc or "error" in unc:
        return f"{rec['cpu_seconds']:.2f} s"
    return f"{rec['cpu_seconds'] / unc['cpu_seconds']:.2f}"


def memory_markdown(result: dict[str, Any]) -> str:
    """The peak and time tables (one row per variant, one column per prompt length), the
    targets, the 7B-heads relevance point and every failed point with its reason."""
    cfg, d = result["config"], result["decoder"]
    lengths, by = cfg["lengths"], _by(result)
    variants = [UNCOMPRESSED, *cfg["presets"]]
    head = "| variant | " + " | ".join(f"{n:,}" for n in lengths) + " |"
    rule = "|---|" + "---:|" * len(lengths)
    lines = [
        f"LLaVA-1.5-shaped random model: {d['layers']} layers, width {d['hidden']} ({d['heads']} "
        f"heads of {d['head_dim']}), MLP {d['intermediate']}, one 24x24 image (576 vision "
        f"tokens), {cfg['text_before']} text tokens before it and the rest of the prompt after "
        f"it; each point in its own process, {result['machine']['threads']} thread(s): the peak "
        f"of one prefill after a short warm-up, then the CPU time of {cfg['repeats']} prefill(s) "
        "(median) after an untimed one, in a steady heap.",
        "",
        "Peak resident set of the process during the prefill, GB (difference to the "
        "uncompressed model's), by prompt tokens:",
        "",
        head,
        rule,
    ]
    for v in variants:
        unc = [by.get((UNCOMPRESSED, n)) for n in lengths]
        cells = [_cell_gb(by.get((v, n)), u) for n, u in zip(lengths, unc)]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Prefill CPU time: seconds for the uncompressed model, the preset's ratio to it below:",
        "",
        head,
        rule,
    ]
    for v in variants:
        unc = [by.get((UNCOMPRESSED, n)) for n in lengths]
        cells = [_cell_time(by.get((v, n)), u) for n, u in zip(lengths, unc)]
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    t = result["targets"]
    mem, tim = t["memory"], t["time"]
    lines += ["", "Targets:", ""]
    lines.append(
        f"* peak within {mem['limit_bytes'] / 1e9:.2f} GB of the uncompressed model's at "
        f"{mem['length']:,} tokens: "
        + (
            "every preset"
            if mem["passed"]
            else "over: " + ", ".join(f"{p} (+{b / 1e9:.2f} GB)" for p, b in mem["over"].items())
        )
    )
    lines.append(
        f"* prefill no slower than uncompressed at {tim['length']:,} tokens: "
        + (
            "every preset"
            if tim["passed"]
            else "slower: " + ", ".join(f"{p} ({r:.2f}x)" for p, r in tim["over"].items())
        )
    )
    w = result.get("width7b")
    if w and "error" not in w:
        lines += [
            "",
            f"`query_softmax` alone at a 7B decoder's heads ({w['heads']} of {w['head_dim']}, "
            f"float32) on {w['length']:,} tokens ({w['text_tokens']:,} text): "
            f"{w['peak_above_inputs_bytes'] / 1e9:.3f} GB above its "
            f"{w['inputs_bytes'] / 1e9:.2f} GB of queries and keys, {w['cpu_seconds']:.1f} s of "
            f"CPU; the H x N x T scores it never holds at once are "
            f"{w['scores_bytes_at_once_before'] / 1e9:.1f} GB. Its products are "
            f"{w['relevance_flops'] / w['layer_flops_7b']:.0%} of one LLaVA-1.5-7B decoder "
            "layer's FLOPs on those tokens (a stage's relevance, once per stage).",
        ]
    elif w:
        lines += ["", f"`query_softmax` at 7B heads failed: {w['error']}"]
    failed = [p for p in result["points"] if "error" in p]
    if failed:
        lines += ["", "Points that did not run:", ""]
        lines += [f"* {p['variant']} at {p['length']:,}: {p['error']}" for p in failed]
    return "\n".join(lines) + "\n"


def memory_plot(result: dict[str, Any], path: Path) -> Path | None:
    """Peak resident set and prefill CPU time against prompt length, one line per variant
    (the uncompressed model in black); None without matplotlib."""
    from lightkv_lab import vis

    try:
        plt = vis.pyplot()
    except ImportError:
        return None
    cfg, by = result["config"], _by(result)
    variants = [UNCOMPRESSED, *cfg["presets"]]
    fig, (*axes, key) = plt.subplots(
        1, 3, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1, 1, 0.42]}
    )
    colours, styles = plt.get_cmap("tab20").colors, ["-", "--", ":", "-."]
    for i, v in enumerate(variants):
        pts = [by.get((v, n)) for n in cfg["lengths"]]
        pts = [p for p in pts if p and "error" not in p]
        if not pts:
            continue
        xs = [p["length"] for p in pts]
        style = (
            {"color": "black", "lw": 2.4, "ls": "-", "zorder": 5}
            if v == UNCOMPRESSED
            else {"color": colours[i % len(colours)], "lw": 1.1, "ls": styles[(i // 20) % 4]}
        )
        axes[0].plot(xs, [p["peak_bytes"] / 1e9 for p in pts], marker=".", label=v, **style)
        axes[1].plot(xs, [p["cpu_seconds"] for p in pts], marker=".", **style)
    axes[0].set_ylabel("peak resident set during the prefill (GB)")
    axes[1].set_ylabel("prefill CPU time (s)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("prompt tokens (576 of them vision)")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    d = result["decoder"]
    fig.suptitle(
        f"prefill memory and time vs prompt length (LLaVA-1.5 shape, {d['layers']} layers, width "
        f"{d['hidden']})",
        fontsize=10,
    )
    key.axis("off")  # the legend's own panel: the layout then leaves room for it
    key.legend(*axes[0].get_legend_handles_labels(), loc="center left", fontsize=6.5, frameon=False)
    return vis.save_figure(fig, path)


def write_memory(result: dict[str, Any], out_dir: Path, with_plot: bool = True) -> list[Path]:
    """``prefill-memory.json`` and ``.md`` (each written atomically, both rendered first) and,
    with matplotlib, ``prefill-memory.png`` in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = {
        out_dir / "prefill-memory.json": json.dumps(result, indent=2) + "\n",
        out_dir / "prefill-memory.md": memory_markdown(result),
    }
    for path, text in texts.items():
        write_atomic(path, text)
    files = list(texts)
    if with_plot:
        png = memory_plot(result, out_dir / "prefill-memory.png")
        if png is not None:
            files.append(png)
    return files
