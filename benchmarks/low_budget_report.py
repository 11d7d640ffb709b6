"""Tables of ``benchmarks/low_budget_layout.py``'s runs: the development search, the
evaluation against the +merge variants and the leaders, the held-out constructions.

Every difference is ``lightkv-cover`` minus the other method on the same conversations
(points of exact-match accuracy), with a paired bootstrap 95% interval
(`lightkv_lab.tasks.scoring.paired_bootstrap`, 2,000 resamples, seed 0); "above" / "level" /
"below": the interval above 0, containing it, below it. ``first``: the first answer (the
results pages' "retained" divides it by the uncompressed model's); ``follow-up``: the answer to
the second question, about another object, read from the cache compressed for the first;
``both``: the mean of the two per conversation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightkv_lab.tasks.scoring import paired_bootstrap

from lightkv.outputs import write_atomic

COVER = "lightkv-cover"
ONE_WINDOW_KS = (0, 3, 4, 6, 8, 10, 15)


def _load(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _metric(r: dict, which: str) -> torch.Tensor:
    first = torch.tensor(r["correct"], dtype=torch.float64)
    follow = torch.tensor(r["followup_correct"], dtype=torch.float64)
    return {"first": first, "follow-up": follow, "both": (first + follow) / 2}[which]


def _verdict(lo: float, hi: float) -> str:
    return "above" if lo > 0 else ("below" if hi < 0 else "level")


def _dev(rows: list[dict]) -> tuple[list[dict], str]:
    base = next(r for r in rows if r["label"] == "uncompressed")
    lines = [
        f"Development split: Scenes, {base['n']} conversations, seed {base['seed']} "
        f"(uncompressed: first {base['first']:.4f}, follow-up {base['followup']:.4f}).\n",
        "| configuration | target | kept | first | follow-up |",
        "|---|---:|---:|---:|---:|",
    ]
    out = []
    for r in rows:
        if r["label"] == "uncompressed":
            continue
        lines.append(
            f"| {r['label']} | {r['target']:.0%} | {r['kept']:.1%} | {r['first']:.4f} | "
            f"{r['followup']:.4f} |"
        )
        out.append({k: r[k] for k in ("label", "target", "kept", "first", "followup")})
    # K: which layout each budget gets on a 16 x 16 image, read off the two layouts' rows
    two = {r["target"]: r for r in rows if r["label"] == "cover 2x2 (K=0)"}
    one = {r["target"]: r for r in rows if r["label"] == "cover 1 window"}
    targets = sorted(set(two) & set(one), reverse=True)
    lines += [
        "",
        "K (min_kept_per_window) on a 16 x 16 image: the budgets where it selects in one window "
        "(kept < 4 K), and the development first-answer accuracy it gets there (grid distance "
        "0.25 in both layouts; the shipped K = 8 also drops the grid distance in one window, "
        "row `lightkv-cover (K=8, ...)` above).\n",
        "| K | "
        + " | ".join(
            f"{t:.0%} ({256 - int(256 * (1 - t) + 1e-9)} kept, "
            f"{(256 - int(256 * (1 - t) + 1e-9)) / 4:g}/window)"
            for t in targets
        )
        + " | mean |",
        "|---:|" + "---:|" * (len(targets) + 1),
    ]
    for k in ONE_WINDOW_KS:
        cells, accs = [], []
        for t in targets:
            kept = 256 - int(256 * (1 - t) + 1e-9)
            r = one[t] if kept < 4 * k else two[t]
            accs.append(r["first"])
            cells.append(f"{r['first']:.4f}{' (1 w)' if kept < 4 * k else ''}")
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {sum(accs) / len(accs):.4f} |")
    return out, "\n".join(lines) + "\n"


def _compare(rows: list[dict], title: str) -> tuple[list[dict], str]:
    base = next(r for r in rows if r["label"] == "uncompressed")
    cover = {r["target"]: r for r in rows if r["label"] == COVER}
    lines = [
        f"{title}: Scenes, {base['n']} conversations, seed {base['seed']} (uncompressed: first "
        f"{base['first']:.4f}, follow-up {base['followup']:.4f}). Differences: `lightkv-cover` "
        "minus the method, points, paired bootstrap 95% interval.\n",
        "| target | method | kept | first (retained) | follow-up | cover - method, first | "
        "cover - method, follow-up | cover - method, both | first |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    out = []
    order = sorted(
        (r for r in rows if r["label"] != "uncompressed"),
        key=lambda r: (-r["target"], r["label"] != COVER, r["label"]),
    )
    for r in order:
        c = cover.get(r["target"])
        row = {k: r[k] for k in ("label", "target", "kept", "first", "followup", "construction")}
        row["retained"] = r["first"] / base["first"]
        cells = ["", "", "", ""]
        if c is not None and r["label"] != COVER:
            for i, m in enumerate(("first", "follow-up", "both")):
                d = [100 * v for v in paired_bootstrap(_metric(c, m), _metric(r, m))]
                row[f"cover_minus_{m}"] = d
                cells[i] = "{:+.1f} [{:+.1f}, {:+.1f}]".format(*d)
            cells[3] = _verdict(*row["cover_minus_first"][1:])
        out.append(row)
        lines.append(
            f"| {r['target']:.0%} | {r['label']} | {r['kept']:.1%} | {r['first']:.4f} "
            f"({row['retained']:.1%}) | {r['followup']:.4f} | " + " | ".join(cells) + " |"
        )
    return out, "\n".join(lines) + "\n"


def report(out: Path) -> None:
    """Write ``results.json`` and ``results.md`` in ``out`` from its JSON-lines logs."""
    result: dict = {}
    parts = []
    dev = _load(out / "dev.jsonl")
    if dev:
        result["dev"], md = _dev(dev)
        parts.append("## Development split\n\n" + md)
    ev = _load(out / "eval.jsonl")
    if ev:
        result["eval"], md = _compare(ev, "Evaluation")
        parts.append("## Evaluation (fresh i.i.d. conversations)\n\n" + md)
    held = _load(out / "heldout.jsonl")
    result["heldout"] = {}
    for name in dict.fromkeys(r["construction"] for r in held):
        rows = [r for r in held if r["construction"] == name]
        result["heldout"][name], md = _compare(rows, f"Held-out construction '{name}'")
        parts.append(f"## Held-out: {name}\n\n" + md)
    write_atomic(out / "results.json", json.dumps(result, indent=1))
    write_atomic(out / "results.md", "\n".join(parts))
