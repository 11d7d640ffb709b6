"""Join quality results that ran in parallel processes over parts of the method list.

Each part must be the same run split by ``--methods`` (same model, conversations, seed, kept
fractions and baseline, which every part includes): the uncompressed rows must be equal, the
baseline's rows are taken once, and the joined result is written as the quality benchmark
writes one (`lightkv_lab.bench.quality_report.write_outputs`).

    python benchmarks/merge_quality.py OUT_DIR PART.json [PART.json ...] [--model photos]

With ``--replace`` a later part's rows replace an earlier part's rows of the same method and
kept fraction (a re-run of some methods after a fix to them), in the earlier part's order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightkv_lab.bench.quality_report import write_outputs

SAME = ("benchmark", "baseline", "model", "grid", "qtypes")


def merge(parts: list[dict], replace: bool = False) -> dict:
    """One result from ``parts`` (see the module docstring; ``replace``: later rows win).

    Raises:
        ValueError: parts of different runs (naming the first field that differs).
    """
    first = parts[0]
    for p in parts[1:]:
        for key in SAME + ("uncompressed",):
            if p[key] != first[key]:
                raise ValueError(f"parts differ in {key!r}: not one run split by --methods")
        for key in ("episodes", "seed", "targets", "followup"):
            if p["config"][key] != first["config"][key]:
                raise ValueError(f"parts differ in config {key!r}: not one run split by --methods")
    rows: list[dict] = []
    where: dict[tuple, int] = {}
    for p in parts:
        for r in p["rows"]:
            key = (r["method"], r["target"])
            if key not in where:
                where[key] = len(rows)
                rows.append(r)
            elif replace:
                rows[where[key]] = r
    out = dict(first)
    out["rows"] = rows
    out["ablations"] = [a for p in parts for a in p["ablations"]]
    out["config"] = dict(first["config"], methods=list(dict.fromkeys(r["method"] for r in rows)))
    out["seconds"] = sum(p["seconds"] for p in parts)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("parts", nargs="+", type=Path)
    ap.add_argument("--model", default=None, help="the model for the provenance picture")
    ap.add_argument("--replace", action="store_true", help="later parts' rows replace earlier")
    args = ap.parse_args(argv)
    result = merge([json.loads(p.read_text()) for p in args.parts], replace=args.replace)
    for path in write_outputs(result, args.out, args.model):
        print(path)


if __name__ == "__main__":
    main()
