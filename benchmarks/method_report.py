"""The low-budget table in the field's format from `method_search.py`'s JSON lines.

For every configuration and kept fraction: accuracy retained (% of the uncompressed model on
the same conversations), both budget columns (the vision KV kept averaged over the decoder's
layers, lightkv's; the vision tokens left after the method's last stage, the papers'), and
paired 95% bootstrap intervals against DivPrune, CDPruner and the method with relevance off.

    python benchmarks/method_report.py benchmarks/results/method-search/final-seed0-n600.jsonl \
        benchmarks/results/method-search/final-seed4102-n1000.jsonl \
        --out benchmarks/results/method-search/final
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightkv_lab.tasks.scoring import paired_bootstrap
from method_search import build

from lightkv import ImageSegment, VisionLayout
from lightkv.policies import Prompt

LAYERS, GRID = 12, (16, 16)  # the Scenes model


def label(cfg: dict) -> str:
    if cfg.get("uncompressed"):
        return "uncompressed"
    name = cfg["preset"]
    extra = []
    if "pruner" in cfg and name != "lightkv-cover":
        extra.append(cfg["pruner"][0])
    if (
        name == "lightkv-cover" and "version" not in cfg
    ):  # before the cost round: question_attention, one window
        extra.append("v1")
    if name == "lightkv-cover" and cfg.get("relevance", ["question_attention"])[0] == "uniform":
        extra.append("relevance off")
    if "passer" in cfg and name != "lightkv-cover":
        extra.append(f"+ merge ({cfg['passer'][0]})")
    if cfg.get("proportional") and name != "lightkv-cover":
        extra.append("+ proportional attention")
    return " ".join([name, *extra])


def tokens_after_last_stage(cfg: dict, target: float) -> float:
    """Vision tokens left after the last stage, as a fraction of one 16 x 16 image (a dry run
    of the schedule on random features: the counts depend on the ratios, not the content)."""
    pipe, _ = build(cfg, LAYERS, target)
    n = GRID[0] * GRID[1]
    layout = VisionLayout.from_segments(1, n + 4, [ImageSegment(row=0, offset=1, grid=GRID)])
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, n + 4, 16, generator=gen)
    keys = torch.randn(1, n + 4, 2, 8, generator=gen)
    try:
        results = pipe.run(
            hidden,
            layout,
            LAYERS,
            relevance=torch.rand(1, n + 4, generator=gen) + 0.1,
            key_states=keys,
            prompt=Prompt(torch.arange(n + 4).unsqueeze(0)),
        )
    except (ValueError, NotImplementedError):  # a cache method (no hidden-state stages)
        return float("nan")
    return int(results[-1].layout.vision_counts()[0]) / n if results else 1.0


def load(paths: list[Path]) -> dict:
    """``{(label, target): {"correct": tensor, "kept": float, "cfg": dict}}`` concatenated over
    the files (each file's conversations in order), plus the uncompressed run."""
    out: dict = {}
    for path in paths:
        for rec in map(json.loads, path.read_text().splitlines()):
            k = (label(rec["cfg"]), rec["target"])
            entry = out.setdefault(k, {"correct": [], "kept": [], "cfg": rec["cfg"], "files": []})
            entry["correct"].append(torch.tensor(rec["correct"], dtype=torch.float64))
            entry["kept"].append(rec["kept"])
            entry["files"].append(path.name)
    return out


def write_list(paths: list[Path], out: Path) -> int:
    """Every configuration of the files with its accuracy at each target (a development log)."""
    lines = [
        "| file | configuration | target | kept | accuracy | count | read | follow-up |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in paths:
        for rec in map(json.loads, path.read_text().splitlines()):
            acc = rec["accuracy"]
            overall = rec.get("overall", sum(rec["correct"]) / len(rec["correct"]))
            cfg = json.dumps(rec["cfg"], separators=(",", ":")).replace("|", "/")
            lines.append(
                f"| {path.name} | `{cfg}` | {rec['target']:.2f} | {rec['kept']:.3f} | "
                f"{overall:.4f} | {acc.get('count', float('nan')):.3f} | "
                f"{acc.get('read', float('nan')):.3f} | {acc.get('followup', float('nan')):.3f} |"
            )
    target = out.with_suffix(".md")
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, target)
    print(f"{len(lines) - 2} runs -> {target}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    ap.add_argument(
        "--list",
        action="store_true",
        help="list every configuration tried (a development log) instead of the paired table",
    )
    args = ap.parse_args(argv)
    if args.list:
        return write_list(args.files, args.out)
    runs = load(args.files)
    full_files = runs[("uncompressed", 1.0)]["files"]
    full = torch.cat(runs[("uncompressed", 1.0)]["correct"])
    rows, summary = [], []
    for (name, target), entry in sorted(runs.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        if name == "uncompressed" or entry["files"] != full_files:
            continue  # only what ran on every file's conversations
        x = torch.cat(entry["correct"])
        rec = {
            "method": name,
            "target": target,
            "kept_kv": sum(entry["kept"]) / len(entry["kept"]),
            "kept_tokens": tokens_after_last_stage(entry["cfg"], target),
            "n": int(x.numel()),
            "accuracy": float(x.mean()),
            "retained": float(x.mean() / full.mean()),
        }
        for ref in ("divprune", "cdpruner", "lightkv-cover relevance off", "lightkv"):
            other = runs.get((ref, target))
            if other is not None and ref != name and other["files"] == full_files:
                d, lo, hi = paired_bootstrap(x, torch.cat(other["correct"]), 2000, 0)
                rec[f"minus {ref}"] = [100 * d, 100 * lo, 100 * hi]
        summary.append(rec)

    def iv(r: dict, key: str) -> str:
        v = r.get(key)
        return "" if v is None else f"{v[0]:+.1f} [{v[1]:+.1f}, {v[2]:+.1f}]"

    for r in summary:
        rows.append(
            f"| {r['method']} | {100 * r['target']:.0f}% | {100 * r['kept_kv']:.1f}% | "
            f"{100 * r['kept_tokens']:.1f}% | {100 * r['retained']:.1f}% | "
            f"{iv(r, 'minus divprune')} | {iv(r, 'minus cdpruner')} | {iv(r, 'minus lightkv')} | "
            f"{iv(r, 'minus lightkv-cover relevance off')} |"
        )
    md = [f"Conversations: {', '.join(p.name for p in args.files)} (n = {full.numel()}); "
          f"uncompressed accuracy {full.mean():.4f}. Differences: points of first-answer accuracy, "
          "the row's method minus the column's on the same conversations, paired bootstrap 95% "
          "interval (2,000 resamples).", "",
          "| method | target | vision KV kept (avg over layers) | tokens after last stage | "
          "retained | minus DivPrune | minus CDPruner | minus lightkv | minus lightkv-cover "
          "(relevance off) |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, ""]  # fmt: skip
    # the most any relevance could win: conversations the uncompressed model answers right and
    # the method with relevance off answers wrong (and the reverse, which relevance cannot fix)
    head = []
    for (name, target), entry in sorted(runs.items(), key=lambda kv: -kv[0][1]):
        if name == "lightkv-cover relevance off" and entry["files"] == full_files:
            off = torch.cat(entry["correct"])
            on = runs.get(("lightkv-cover", target))
            won = "" if on is None else f"{int(((1 - off) * torch.cat(on['correct'])).sum())}"
            lost = "" if on is None else f"{int((off * (1 - torch.cat(on['correct']))).sum())}"
            head.append(
                f"| {100 * target:.0f}% | {int((full * (1 - off)).sum())} "
                f"({100 * float((full * (1 - off)).mean()):.1f}%) | "
                f"{int(((1 - full) * off).sum())} | {won} | {lost} |"
            )
    if head:
        md += [
            "Headroom for relevance: of the same conversations, how many the uncompressed model "
            "answers right and `lightkv-cover` with relevance off answers wrong (the most any "
            "relevance could win back), the reverse, and how many turning relevance on wins and "
            "loses.",
            "",
            "| target | uncompressed right, off wrong | off right, uncompressed wrong | on right, "
            "off wrong | off right, on wrong |",
            "|---:|---:|---:|---:|---:|",
            *head,
            "",
        ]
    for suffix, text in (
        (
            ".json",
            json.dumps(
                {"uncompressed": float(full.mean()), "n": int(full.numel()), "rows": summary},
                indent=1,
            ),
        ),
        (".md", "\n".join(md)),
    ):
        target = args.out.with_suffix(suffix)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, target)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
