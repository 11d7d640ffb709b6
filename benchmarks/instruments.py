"""Two instruments side by side: every method's retained accuracy on Scenes and on Photos at
the same kept fractions, its rank on each, and whether its rank moved.

Retained = 100 x the method's first-answer accuracy / the uncompressed model's, from two
quality results (`lightkv bench quality`, ``quality-<task>.json``); ranks are per kept
fraction among the methods both results hold at that fraction (1 = best; ties share the better
rank), and a rank "moved" when it differs by more than ``--moved`` places (default 2). A method
that cannot reach a fraction on a model runs at the nearest one it can (``how: "nearest"``):
it is listed with its number but left out of that fraction's ranks, as are cache methods in a
run without follow-up questions (their compression acts after the first answer's first token).

    python benchmarks/instruments.py benchmarks/results/quality-scenes.json \
        benchmarks/results/quality-photos.json --out benchmarks/results/instruments
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightkv.outputs import write_atomic


def retained(result: dict) -> dict[tuple[str, float], float]:
    """``(method, target) -> retained %`` of one quality result."""
    base = result["uncompressed"]["accuracy"]["overall"]
    if not base:
        raise ValueError(f"{result['benchmark']}: the uncompressed model answers nothing right")
    return {
        (r["method"], round(r["target"], 4)): 100 * r["accuracy"]["overall"] / base
        for r in result["rows"]
        if r["target"] < 1.0
    }


def _nearest(result: dict) -> set[tuple[str, float]]:
    """``(method, target)`` pairs left out of the ranks: run at the nearest reachable fraction
    instead, or a cache method in a run without follow-ups (it compresses the cache after the
    prefill, so a first answer read from the prefill's own logits barely sees it)."""
    blind = result.get("config", {}).get("followup", True) is False
    return {
        (r["method"], round(r["target"], 4))
        for r in result["rows"]
        if r.get("how") == "nearest" or (blind and r.get("how") == "cache")
    }


def ranks(values: dict[str, float]) -> dict[str, int]:
    """Competition ranks, best (highest) first: ties share the better rank."""
    order = sorted(values.values(), reverse=True)
    return {m: 1 + order.index(v) for m, v in values.items()}


def compare(a: dict, b: dict, moved: int = 2) -> dict:
    """Rows ``{method, target, a, b, rank_a, rank_b, moved}`` for every (method, target) in
    both results; ``a``/``b`` keep their task names."""
    ra, rb = retained(a), retained(b)
    off = _nearest(a) | _nearest(b)
    common = sorted(set(ra) & set(rb), key=lambda k: (-k[1], k[0]))
    rows = []
    for target in sorted({t for _, t in common}, reverse=True):
        methods = [m for m, t in common if t == target]
        ranked = [m for m in methods if (m, target) not in off]
        rank_a = ranks({m: ra[(m, target)] for m in ranked})
        rank_b = ranks({m: rb[(m, target)] for m in ranked})
        for m in methods:
            r_a, r_b = rank_a.get(m), rank_b.get(m)
            rows.append({
                "method": m, "target": target, "a": ra[(m, target)], "b": rb[(m, target)],
                "rank_a": r_a, "rank_b": r_b,
                "moved": None if r_a is None or r_b is None else abs(r_a - r_b) > moved,
            })  # fmt: skip
    return {"a": a["model"]["task"], "b": b["model"]["task"], "moved_places": moved, "rows": rows}


def markdown(c: dict) -> str:
    """One table per kept fraction, methods by their rank on ``b``."""
    out = [f"# Retained accuracy (%) on {c['a']} and {c['b']}, ranks and whether they moved\n"]
    for target in sorted({r["target"] for r in c["rows"]}, reverse=True):
        out += [
            f"\n## {100 * target:.0f}% kept\n",
            f"| method | {c['a']} | rank | {c['b']} | rank | rank moved (> {c['moved_places']}) |",
            "|---|---:|---:|---:|---:|---|",
        ]
        rows = sorted(
            (r for r in c["rows"] if r["target"] == target),
            key=lambda r: (r["rank_b"] is None, r["rank_b"] or 0, -r["b"]),
        )
        for r in rows:
            if r["moved"] is None:  # not at this fraction on one model: no rank
                out.append(
                    f"| {r['method']} | {r['a']:.1f} | - | {r['b']:.1f} | - "
                    "| (not ranked: nearest fraction or cache) |"
                )
                continue
            move = f"{r['rank_a'] - r['rank_b']:+d}" if r["moved"] else ""
            out.append(
                f"| {r['method']} | {r['a']:.1f} | {r['rank_a']} | {r['b']:.1f} | {r['rank_b']} "
                f"| {move} |"
            )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--moved", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/instruments"))
    args = ap.parse_args(argv)
    c = compare(json.loads(args.a.read_text()), json.loads(args.b.read_text()), args.moved)
    write_atomic(args.out.with_suffix(".json"), json.dumps(c, indent=1) + "\n")
    write_atomic(args.out.with_suffix(".md"), markdown(c))
    print(markdown(c))
    return c


if __name__ == "__main__":
    main()
