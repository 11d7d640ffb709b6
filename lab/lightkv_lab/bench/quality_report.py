"""Tables, plots and the provenance picture of the quality benchmark (`lightkv_lab.bench.quality`).

This module imports `lightkv_lab.bench.quality` (for the methods' pipelines), never the other
way round; pictures are drawn with `lightkv_lab.vis`. The provenance picture is drawn by
`lightkv_lab.bench.provenance`."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightkv.outputs import write_atomic
from lightkv_lab import vis
from lightkv_lab.bench.provenance import provenance_picture

__all__ = [
    "accuracy_cell",
    "detail_accuracy",
    "markdown_table",
    "plot",
    "provenance_picture",
    "write_outputs",
]

FLAGS = {
    "scaled": "",
    "extra stages": " (+stages)",
    "min": " (min)",
    "nearest": " (nearest)",
    "cache": " (cache)",
    "before the LLM": " (pre-LLM)",
    "before the LLM and later": " (pre-LLM + later)",
}


def detail_accuracy(row: dict[str, Any], result: dict[str, Any]) -> float:
    """Mean accuracy over the detail question types (answers in single tokens or cells) that
    the run drew (NaN when it drew none: a short run need not draw every type); ``result``
    is any mapping with ``detail_qtypes`` (a benchmark's result or one model's entry)."""
    acc = [row["accuracy"][q] for q in result["detail_qtypes"] if q in row["accuracy"]]
    return sum(acc) / len(acc) if acc else math.nan


def accuracy_cell(row: dict[str, Any], q: str) -> str:
    """A row's accuracy on question type ``q`` for a table, or '-' for a type the run never
    drew (``--episodes 2`` need not draw every type)."""
    value = row["accuracy"].get(q)
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def _num(value: float, fmt: str = "{:.3f}") -> str:
    return "-" if math.isnan(value) else fmt.format(value)


def _ci(v: Sequence[float] | None, scale: float = 100.0, fmt: str = "{:+.1f}") -> str:
    if not v:
        return ""
    m, lo, hi = (x * scale for x in v)
    return f"{fmt.format(m)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def markdown_table(result: dict[str, Any]) -> str:
    """Accuracy per method and target; per-type accuracy, KL and log-probability drop; the
    ablation table at 55%; the relevance-mass table."""
    rows = result["rows"]
    qtypes = list(dict.fromkeys(result["qtypes"]))  # a mix lists a type once per share
    detail = result["detail_qtypes"]
    model = result["model"]
    n = result["config"]["episodes"]
    targets = sorted({r["target"] for r in rows}, reverse=True)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    intro = (
        f"Model `{model['name']}` ({model['task']}, {model['vision_tokens']} vision tokens, "
        f"{model['layers']} decoder layers), {n} held-out conversations. Cells: overall accuracy / "
        f"detail accuracy ({', '.join(detail)}) @ realised kept fraction."
    )
    lines = [intro, ""]
    lines += [
        "| method | " + " | ".join(f"{t:.0%} target" for t in targets) + " |",
        "|---" * (len(targets) + 1) + "|",
    ]
    for m in methods:
        cells = []
        for t in targets:
            r = next((r for r in rows if r["method"] == m and r["target"] == t), None)
            cells.append(
                ""
                if r is None
                else f"{r['accuracy']['overall']:.3f} / {_num(detail_accuracy(r, result))} @ "
                f"{r['kept_fraction']:.2f}{FLAGS[r['how']]}"
            )
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    ref = result.get("baseline")
    lines += retained_lines(result)
    has_f = "followup" in result["uncompressed"]["accuracy"]
    cols = qtypes + (["followup"] if has_f else [])
    per_type = (
        "Per question type: accuracy; KL(p_uncompressed || p_compressed) per answer token (nats, "
        "overall); log-probability drop of the reference answer (overall, episodes the "
        "uncompressed model answers right); "
        + (
            f"{ref} (the comparator, `--baseline`) minus this method in detail accuracy (points) "
            f"and in KL (nats, negative: {ref} more faithful), each with a paired bootstrap 95% "
            f"interval ('-': the comparator's own row, or a target {ref} did not run at)."
            if ref
            else "no intervals: none of the methods is a lightkv method, and no --baseline "
            "names a comparator (`lightkv bench quality --baseline NAME`)."
        )
    )
    who = ref or "comparator"
    header = (
        "| method | target | kept | "
        + " | ".join(cols)
        + f" | KL | logp drop | {who} - this, {detail[0]} | {who} - this, KL | vision KV / "
        "episode |"
    )
    lines += ["", per_type, "", header, "|---" * (len(cols) + 8) + "|"]
    for r in [result["uncompressed"]] + [r for r in rows if r["target"] < 1.0]:
        lines.append(_type_line(r, cols, detail[0]))
    for target in dict.fromkeys(r["target"] for r in result.get("ablations") or []):
        intro = (
            f"Ablations at {target:.0%} kept: LightKV with one part swapped. "
            "Last columns: lightkv minus the variant, points, paired bootstrap 95% interval."
        )
        header = (
            "| variant | kept | "
            + " | ".join(cols)
            + " | KL | "
            + " | ".join(f"lightkv - this, {q}" for q in cols)
            + " | lightkv - this, KL |"
        )
        lines += ["", intro, "", header, "|---" * (2 * len(cols) + 4) + "|"]
        light = next((r for r in rows if r["method"] == "lightkv" and r["target"] == target), None)
        for r in ([light] if light else []) + [
            a for a in result["ablations"] if a["target"] == target
        ]:
            vs = r.get("vs_baseline", {}).get("accuracy", {})
            vkl = r.get("vs_baseline", {}).get("kl", {}).get("overall")
            lines.append(
                f"| {r['method']} | {r['kept_fraction']:.3f} | "
                + " | ".join(accuracy_cell(r, q) for q in cols)
                + f" | {r['kl']['overall']:.2e} | "
                + " | ".join(_ci(vs.get(q)) or "-" for q in cols)
                + f" | {_ci(vkl, 1.0, '{:+.1e}') or '-'} |"
            )
    rel = result.get("relevance_mass")
    if rel:
        intro = (
            "Share of the image's relevance mass on the asked cell vs another cell ('what' "
            f"questions, {rel['episodes']} episodes; area share of a cell {rel['area_share']:.4f}):"
        )
        lines += [
            "",
            intro,
            "",
            "| after layer | query-axis ξ: asked | control | last-token attention: asked | control "
            "|",
            "|---|---|---|---|---|",
        ]
        for layer, d in rel["layers"].items():
            q, t = d["query_softmax"], d["last_token"]
            lines.append(
                f"| {layer} | {q['asked']:.3f} | {q['control']:.3f} | {t['asked']:.3f} | "
                f"{t['control']:.3f} |"
            )
    lines += _region_lines(result)
    return "\n".join(lines) + "\n"


def retained_lines(result: dict[str, Any]) -> list[str]:
    """The field's format: overall accuracy as a share of the uncompressed model's, method x
    kept-fraction target, with the comparator minus the method (points, paired bootstrap
    95%; result ``baseline``), or a note why there are no intervals."""
    rows = [r for r in result["rows"] if r["target"] < 1.0]
    base = result["uncompressed"]["accuracy"]["overall"]
    if not rows or not base:
        return []
    targets = sorted({r["target"] for r in rows}, reverse=True)
    ref = result.get("baseline")
    vs = (
        f"and in brackets {ref} (the comparator) minus the method in overall accuracy (points, "
        "paired bootstrap 95% interval)"
        if ref
        else "without intervals (none of the methods is a lightkv method and no --baseline "
        "names a comparator)"
    )
    lines = [
        "",
        "Retained accuracy, % of the uncompressed model's overall accuracy (the field's format), "
        f"{vs}; a flag marks a method that missed the target (see the kept fraction above).",
        "",
        "| method | " + " | ".join(f"{t:.0%}" for t in targets) + " |",
        "|---" * (len(targets) + 1) + "|",
    ]
    for m in dict.fromkeys(r["method"] for r in rows):
        cells = []
        for t in targets:
            r = next((r for r in rows if r["method"] == m and r["target"] == t), None)
            if r is None:
                cells.append("")
                continue
            ci = _ci(r.get("vs_baseline", {}).get("accuracy", {}).get("overall"))
            cells.append(
                f"{100 * r['accuracy']['overall'] / base:.1f}%{FLAGS[r['how']]}"
                + (f" ({ci})" if ci else "")
            )
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def _region_lines(result: dict[str, Any]) -> list[str]:
    """The redundancy line and the relevance-on-the-asked-region table (tasks with regions)."""
    lines: list[str] = []
    red = result.get("redundancy")
    if red:
        lines += [
            "",
            f"Redundancy: after layer {red['layer']} (lightkv's first stage), {red['share']:.1%} "
            "of the vision tokens have a neighbour in their stage window with cosine >= "
            f"{red['threshold']} (hidden states minus the image's mean vision token; mean best "
            f"cosine {red['mean_best']:.3f}, {red['tokens']} tokens)"
            + (
                "; >= " + ", >= ".join(f"{t}: {v:.1%}" for t, v in red["shares"].items())
                if "shares" in red
                else ""
            )
            + (
                "; without centring >= "
                + ", >= ".join(f"{t}: {v:.1%}" for t, v in red["raw_shares"].items())
                if "raw_shares" in red
                else ""
            )
            + ".",
        ]
    reg = result.get("region_relevance")
    if reg:
        policies = list(reg["layers"])
        lines += [
            "",
            "Relevance on the asked region as a multiple of its area share (1.0: prompt-blind), "
            "and in brackets the share of questions whose top-ξ token is in the region; "
            f"{reg['episodes']} held-out questions, layers up to lightkv's first stage (after "
            f"layer {reg['first_stage_layer']}):",
            "",
            "| after layer | " + " | ".join(policies) + " |",
            "|---|" + "---|" * len(policies),
        ]
        for layer in reg["layers"][policies[0]]:
            cells = [reg["layers"][p][layer] for p in policies]
            lines.append(
                f"| {layer} | "
                + " | ".join(f"{c['ratio']:.2f}x ({c['top_hit']:.0%})" for c in cells)
                + " |"
            )
    return lines


def _type_line(r: dict[str, Any], cols: list[str], detail: str) -> str:
    vs = r.get("vs_baseline", {}).get("accuracy", {}).get(detail)
    vkl = r.get("vs_baseline", {}).get("kl", {}).get("overall")
    drop = r["logp_drop"].get("overall") if r["logp_drop"] else None
    return (
        f"| {r['method']} | {r['target']:.2f} | {r['kept_fraction']:.3f} | "
        + " | ".join(accuracy_cell(r, q) for q in cols)
        + f" | {r['kl']['overall']:.2e} | {'' if drop is None else f'{drop:.3f}'} | "
        f"{_ci(vs) or '-'} | {_ci(vkl, 1.0, '{:+.1e}') or '-'} | {r['kv_bytes_vision'] / 1024:.0f} "
        "KiB |"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    """Overall accuracy, detail accuracy and KL vs kept fraction, one line per method."""
    plt = vis.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.4), gridspec_kw={"width_ratios": [1, 1, 1, 0.32]})
    key = axes[3]  # the legend's own panel: 18 methods do not fit inside a plot
    methods = list(dict.fromkeys(r["method"] for r in result["rows"]))
    colours = plt.get_cmap("tab20").colors  # 20 distinct colours: one per method up to 20
    markers = "osD^v<>ph*"
    for i, m in enumerate(methods):
        rs = sorted(
            (r for r in result["rows"] if r["method"] == m), key=lambda r: -r["kept_fraction"]
        )
        xs = [r["kept_fraction"] for r in rs]
        style = {
            "ls": "-" if m.startswith("lightkv") else "--",
            "marker": markers[i % len(markers)],
            "label": m,
            "lw": 2.2 if m == "lightkv" else 1.2,
            "color": colours[i % len(colours)],
            "ms": 4,
        }
        axes[0].plot(xs, [r["accuracy"]["overall"] for r in rs], **style)
        axes[1].plot(xs, [detail_accuracy(r, result) for r in rs], **style)
        pts = [(x, r["kl"]["overall"]) for x, r in zip(xs, rs) if r["kl"]["overall"] > 0]
        if pts:
            axes[2].plot(*zip(*pts), **style)
    titles = (
        "all questions (first turn)",
        f"detail questions ({', '.join(result['detail_qtypes'])})",
        "KL(uncompressed || compressed) per answer token",
    )
    for ax, title in zip(axes, titles):
        ax.set_xlabel("kept vision KV fraction (average over layers)")
        ax.set_title(title, fontsize=10)
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out exact match")
    axes[2].set_ylabel("nats")
    axes[2].set_yscale("log")
    key.axis("off")
    key.legend(*axes[0].get_legend_handles_labels(), loc="center left", fontsize=8, frameon=False)
    m = result["model"]
    fig.suptitle(
        f"{m['task']}: {result['config']['episodes']} held-out conversations, {m['vision_tokens']} "
        f"vision tokens, {m['layers']} decoder layers"
    )
    vis.save_figure(fig, path)


def write_outputs(result: dict[str, Any], out: Path, model: str | None = None) -> list[Path]:
    """``quality-<model>.json``, ``.md``, ``.png`` and ``quality-<model>-provenance.png`` under
    ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"quality-{result['model']['task']}"
    paths = [
        out / f"{stem}.json",
        out / f"{stem}.md",
        out / f"{stem}.png",
        out / f"{stem}-provenance.png",
    ]
    result = dict(result)
    result["provenance_example"] = provenance_picture(paths[3], model)
    for path, text in zip(paths, [json.dumps(result, indent=1) + "\n", markdown_table(result)]):
        write_atomic(path, text)  # both rendered before either is written
    plot(result, paths[2])
    return paths
