"""The docs' family table lists every supported family with what is exact and what is refused
(read from the adapter modules' ``Exact:`` / ``Refused:`` docstring lines)."""

from __future__ import annotations

import sys
from pathlib import Path

from lightkv.adapters.registry import SUPPORTED_FAMILIES

HOOKS = Path(__file__).resolve().parents[1] / "docs" / "hooks"


def test_every_family_says_what_is_exact_and_what_is_refused():
    sys.path.insert(0, str(HOOKS))
    try:
        import lightkv_docs
    finally:
        sys.path.remove(str(HOOKS))
    table = lightkv_docs.families_markdown("guides/adapter.md").splitlines()
    rows = {line.split("|")[1].strip().strip("`"): line.split("|") for line in table[2:]}
    assert set(rows) == set(SUPPORTED_FAMILIES)
    for family, cells in rows.items():
        exact, refused = cells[5].strip(), cells[6].strip()
        assert exact and refused, (
            f"{family}: its adapter module's docstring needs 'Exact:' and 'Refused:' lines"
        )


def test_docstring_fields_stop_at_a_blank_line_or_the_next_field():
    sys.path.insert(0, str(HOOKS))
    try:
        import lightkv_docs
    finally:
        sys.path.remove(str(HOOKS))
    doc = "Title.\n\nExact: a,\n  b.\nRefused: c.\n\nMore."
    assert lightkv_docs._docstring_field(doc, "Exact") == "a, b."
    assert lightkv_docs._docstring_field(doc, "Refused") == "c."
    assert lightkv_docs._docstring_field(doc, "Other") == ""
