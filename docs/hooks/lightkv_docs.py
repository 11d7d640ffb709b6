"""MkDocs hooks for the lightkv site (registered in ``mkdocs.yml`` under ``hooks:``).

Everything here reads the repository statically (``ast``, YAML, JSON): the docs build
never imports lightkv, torch or transformers.

* **API reference.** One page per public module of ``lightkv`` is generated and appended
  to the "API reference" section of the nav, so a new module is documented without editing
  ``mkdocs.yml`` and a removed one cannot leave a dangling page. Package pages show the
  package docstring, what the package defines itself, its modules and links to the
  canonical documentation of every name it re-exports.
* **Markers** in pages are replaced before rendering:

  * ``<!-- lightkv:presets -->``: a table of the shipped presets, read from
    ``lightkv/methods/*.yaml``, with each file in a collapsible block
    (``<!-- lightkv:presets table -->``: the table only).
  * ``<!-- lightkv:families -->``: the supported model families, read from
    ``lightkv/adapters/registry.py``, with links to their adapter modules.
  * ``<!-- lightkv:modules -->``: a table of the public modules with their one-line summaries.
  * ``<!-- lightkv:results GLOB [GLOB ...] -->``: every file under ``benchmarks/results``
    matching a glob, rendered in the page (JSON and CSV as tables, Markdown inline, PNG/SVG
    as images); where nothing matches, a note saying the results are not generated yet
    (the page around the marker says which command generates them).
  * ``<!-- lightkv:results-files -->``: a list of everything in ``benchmarks/results``.
  * ``<!-- lightkv:benchmarks -->``: the scripts in ``benchmarks/`` with their summaries.
"""

from __future__ import annotations

import ast
import csv
import fnmatch
import io
import json
import logging
import math
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("mkdocs.hooks.lightkv_docs")

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "lightkv"
LAB_PACKAGE, LAB_DIR = "lightkv_lab", ROOT / "lab" / "lightkv_lab"  # the laboratory's distribution
RESULTS_DIR = ROOT / "benchmarks" / "results"
REFERENCE_DIR = "reference"
NAV_SECTION = "API reference"
SKIP_MODULES = {"__main__"}
# Reading order inside a package; modules not listed follow alphabetically.
PREFERRED_ORDER = {
    "lightkv": [
        "graph",
        "policies",
        "methods",
        "stage",
        "pipeline",
        "config",
        "presets",
        "adapters",
        "api",
        "testing",
        "cli",
    ],
    "lightkv_lab": ["tasks", "bench", "demos", "stages_demo", "vis", "cli"],
    "lightkv.graph": ["layout", "windows", "bipartite", "scatter", "provenance"],
    "lightkv.policies": [
        "base",
        "inputs",
        "partitioners",
        "pooling",
        "scorers",
        "pruners",
        "passers",
        "relevance",
        "schedulers",
        "hashing",
        "plugins",
    ],
    "lightkv.policies.pruners": [
        "base",
        "divergence",
        "relevance_budget",
        "lowest_relevance",
        "random_pruner",
        "all_sources",
        "keep_set",
    ],
    "lightkv.adapters": [
        "base",
        "registry",
        "session",
        "trace",
        "report",
        "cache",
        "masks",
        "features",
        "guards",
        "probes",
    ],
    "lightkv.adapters.cache": ["layer", "quantized", "install", "storage"],
    "lightkv.generate": ["loading", "running", "results", "errors"],
    "lightkv.config": [
        "pipeline",
        "schedule",
        "specs",
        "checks",
        "overrides",
        "quirks",
        "errors",
        "errors_pydantic",
        "yaml_io",
        "schema",
    ],
    "lightkv.testing": ["contract", "models"],
}
RESULT_SUFFIXES = (".json", ".md", ".csv", ".png", ".svg")


# ---------------------------------------------------------------------------- modules
@dataclass
class Module:
    """A public module of the package, read statically."""

    name: str  # dotted
    path: Path
    is_package: bool
    children: list[Module] = field(default_factory=list)

    @property
    def page(self) -> str:
        """Docs-relative path of its reference page."""
        parts = self.name.split(".")
        if self.is_package:
            return posixpath.join(REFERENCE_DIR, *parts, "index.md")
        return posixpath.join(REFERENCE_DIR, *parts) + ".md"

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    def tree(self) -> ast.Module:
        return ast.parse(self.path.read_text(encoding="utf-8"))

    def summary(self) -> str:
        doc = ast.get_docstring(self.tree()) or ""
        first = doc.strip().split("\n\n")[0]
        return " ".join(first.split())

    def walk(self):
        yield self
        for child in self.children:
            yield from child.walk()


def _order(package: str, names: list[str]) -> list[str]:
    preferred = PREFERRED_ORDER.get(package, [])
    return [n for n in preferred if n in names] + sorted(n for n in names if n not in preferred)


def discover(package_dir: Path | None = None, name: str = PACKAGE) -> Module:
    """The package's public module tree (names starting with ``_`` are private)."""
    package_dir = package_dir or ROOT / PACKAGE
    root = Module(name, package_dir / "__init__.py", True)
    entries: dict[str, Module] = {}
    for entry in package_dir.iterdir():
        if entry.name.startswith(("_", ".")):
            continue
        if entry.is_dir() and (entry / "__init__.py").is_file():
            entries[entry.name] = discover(entry, f"{name}.{entry.name}")
        elif entry.suffix == ".py" and entry.stem not in SKIP_MODULES:
            entries[entry.stem] = Module(f"{name}.{entry.stem}", entry, False)
    root.children = [entries[n] for n in _order(name, list(entries))]
    return root


def _literal_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            try:
                return [str(v) for v in ast.literal_eval(node.value)]
            except ValueError:
                return None
    return None


def _defined_names(tree: ast.Module) -> list[str]:
    """Names a module defines itself (not imports), in source order."""
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names.extend(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return names


def _imports(module: Module) -> dict[str, str]:
    """``name -> dotted source`` for every ``from .x import name`` of a module."""
    out: dict[str, str] = {}
    package = module.name if module.is_package else module.name.rsplit(".", 1)[0]
    for node in module.tree().body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            src = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                out[alias.asname or alias.name] = f"{src}.{alias.name}"
    return out


def resolve(target: str, modules: dict[str, Module], depth: int = 0) -> str | None:
    """The canonical dotted path of a re-exported object, following package re-exports."""
    if depth > 5:
        return None
    owner, _, name = target.rpartition(".")
    module = modules.get(owner)
    if module is None:
        return None
    if name in _defined_names(module.tree()):
        return target
    source = _imports(module).get(name)
    if source is None or source == target:
        return None
    if source in modules:  # a module, not an object
        return None
    return resolve(source, modules, depth + 1)


def module_page(module: Module, modules: dict[str, Module]) -> str:
    """Markdown of a module's reference page."""
    if not module.is_package:
        return f"::: {module.name}\n"
    tree = module.tree()
    exported = _literal_all(tree)
    defined = [n for n in _defined_names(tree) if not n.startswith("_")]
    if exported is not None:
        defined = [n for n in defined if n in exported]
    lines = [f"::: {module.name}", "    options:"]
    if defined and module.children:
        lines.append("      members: [" + ", ".join(defined) + "]")
    elif not defined:
        lines.append("      members: false")
    else:
        lines.append("      members: true")
    lines.append("")
    here = posixpath.dirname(module.page)
    if module.children:
        lines += ["## Modules", "", "| module | summary |", "|---|---|"]
        for child in module.children:
            link = posixpath.relpath(child.page, here)
            lines.append(f"| [`{child.name}`]({link}) | {_cell(child.summary())} |")
        lines.append("")
    reexports = []
    imports = _imports(module)
    for name in exported or []:
        if name in defined or name not in imports:
            continue
        canonical = resolve(imports[name], modules)
        reexports.append(f"[`{name}`][{canonical}]" if canonical else f"`{name}`")
    if reexports:
        lines += [
            "## Re-exported names",
            "",
            f"Importable as `from {module.name} import ...`; each link leads to the object's own "
            "page.",
            "",
            ", ".join(reexports),
            "",
        ]
    return "\n".join(lines)


def _nav_entry(module: Module) -> Any:
    if module.children:
        return {module.name: [module.page] + [_nav_entry(c) for c in module.children]}
    return {module.name if module.is_package else module.short: module.page}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------- presets
def presets_markdown(table_only: bool = False) -> str:
    preset_dir = ROOT / PACKAGE / "methods"
    files = {p.stem: p for p in sorted(preset_dir.glob("*.yaml"))}
    if not files:
        return '!!! warning "No presets found"\n    `lightkv/methods/*.yaml` is empty.\n'
    order: list[str] = []
    init = preset_dir / "__init__.py"
    if init.is_file():
        for node in ast.parse(init.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "_ORDER" for t in node.targets
            ):
                try:
                    order = [str(v) for v in ast.literal_eval(node.value)]
                except ValueError:
                    order = []
    names = [n for n in order if n in files] + sorted(set(files) - set(order))
    rows = [
        "| preset | summary | partitioner | scorer | pruner | passer | relevance |",
        "|---|---|---|---|---|---|---|",
    ]
    blocks = []
    for name in names:
        text = files[name].read_text(encoding="utf-8")
        data = yaml.safe_load(text) or {}

        def policy(key: str, data: dict = data) -> str:
            value = data.get(key, "-")
            if isinstance(value, dict):
                params = value.get("params") or {}
                inner = ", ".join(f"{k}={v}" for k, v in params.items())
                return f"`{value.get('name')}`" + (f" ({_cell(inner)})" if inner else "")
            return "none" if value is None else f"`{value}`"

        rows.append(
            f"| `{name}` | {_cell(str(data.get('summary', '')))} | "
            + " | ".join(
                policy(k) for k in ("partitioner", "scorer", "pruner", "passer", "relevance")
            )
            + " |"
        )
        desc = " ".join(str(data.get("description", "")).split())
        source = " ".join(str(data.get("source", "")).split())
        body = [f'??? example "`{name}`: {data.get("summary", "")}"', ""]
        if desc:
            body += [f"    {desc}", ""]
        if source:
            body += [f"    *Source:* {source}", ""]
        body += (
            ["    ```yaml"]
            + [f"    {line}" if line else "" for line in text.rstrip().splitlines()]
            + ["    ```", ""]
        )
        blocks.append("\n".join(body))
    if table_only:
        return "\n".join(rows) + "\n"
    return "\n".join(rows) + "\n\n" + "\n".join(blocks)


# ---------------------------------------------------------------------------- adapters
def _literal_dict(path: Path, name: str) -> dict[str, str]:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if (
            any(isinstance(t, ast.Name) and t.id == name for t in targets)
            and node.value is not None
        ):
            try:
                return dict(ast.literal_eval(node.value))
            except ValueError:
                return {}
    return {}


def families_markdown(page_uri: str) -> str:
    """The adapter registry as a table: family, model types, module (linked), summary."""
    registry = ROOT / PACKAGE / "adapters" / "registry.py"
    if not registry.is_file():
        return (
            '!!! warning "No adapter registry"\n'
            "    `lightkv/adapters/registry.py` does not exist in this checkout.\n"
        )
    families = _literal_dict(registry, "SUPPORTED_FAMILIES")
    model_types = _literal_dict(registry, "MODEL_TYPES")
    modules = {m.name: m for m in _tree().walk()}
    here = posixpath.dirname(page_uri)
    rows = [
        "| family | `config.model_type` | adapter | how it lays out vision tokens | exact | "
        "refused |",
        "|---|---|---|---|---|---|",
    ]
    for family, target in families.items():
        module_name, _, cls = str(target).partition(":")
        types = ", ".join(f"`{t}`" for t, f in model_types.items() if f == family) or "-"
        module = modules.get(module_name)
        if module is None:
            rows.append(f"| `{family}` | {types} | `{target}` (module not found) | | | |")
            continue
        link = posixpath.relpath(module.page, here)
        doc = ast.get_docstring(module.tree()) or ""
        exact, refused = (_cell(_docstring_field(doc, k)) for k in ("Exact", "Refused"))
        rows.append(
            f"| `{family}` | {types} | [`{cls}`]({link}) | {_cell(module.summary())} | {exact} | "
            f"{refused} |"
        )
    return "\n".join(rows) + "\n"


def _docstring_field(doc: str, key: str) -> str:
    """The text of a ``Key: ...`` paragraph of a docstring (up to the next blank line or
    field), "" if absent: adapters state what is exact and what they refuse this way."""
    out: list[str] = []
    for line in doc.splitlines():
        stripped = line.strip()
        if out and (not stripped or stripped.split(":")[0] in ("Exact", "Refused")):
            break
        if stripped.startswith(f"{key}:") or out:
            out.append(stripped.removeprefix(f"{key}:").strip())
    return " ".join(out)


# ---------------------------------------------------------------------------- results
_SCALARS = (str, int, float, bool, type(None))


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == 0:
            return "0"
        if abs(value) >= 1e6 or abs(value) < 1e-3:
            return f"{value:.3e}"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    return str(value)


def _scalar_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, _SCALARS) for v in value)


def _cell_value(value: Any) -> str | None:
    """Text of a table cell; None where the value is left out (nested data, long runs)."""
    if isinstance(value, _SCALARS):
        return _cell(_fmt(value))
    if _scalar_list(value):
        if len(value) <= 4:
            return ", ".join(_fmt(v) for v in value)
        runs: list[list[Any]] = []
        for v in value:
            if runs and runs[-1][0] == v:
                runs[-1][1] += 1
            else:
                runs.append([v, 1])
        if len(runs) <= min(
            6, len(value) // 2
        ):  # e.g. per-layer cache lengths: 611 ×7, 323 ×3, ...
            return ", ".join(_fmt(v) + (f" ×{n}" if n > 1 else "") for v, n in runs)
    return None


def _table(
    rows: list[dict[str, Any]], key_column: str | None = None, keys: list[str] | None = None
) -> str:
    """Rows of records as a Markdown table; a few wide rows are transposed (one column per
    record), so that a table of many metrics stays readable."""
    columns: list[str] = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    cells = [{c: _cell_value(r[c]) if c in r else "" for c in columns} for r in rows]
    omitted = [c for c in columns if any(row[c] is None for row in cells)]
    columns = [c for c in columns if c not in omitted]
    names = [f"**{k}**" for k in keys] if keys else None
    if len(rows) <= 4 and len(columns) > 6:
        single = len(rows) == 1 and not names
        head = [key_column or ("field" if single else "")] + (
            names or (["value"] if single else [f"row {i}" for i in range(len(rows))])
        )
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in columns:
            lines.append("| " + " | ".join([f"`{c}`"] + [row[c] or "" for row in cells]) + " |")
    else:
        head = ([key_column or ""] if names else []) + columns
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for i, row in enumerate(cells):
            lines.append(
                "| "
                + " | ".join(([names[i]] if names else []) + [row[c] or "" for c in columns])
                + " |"
            )
    if omitted:
        lines += [
            "",
            "*Left out of this table (see the JSON file): "
            + ", ".join(f"`{c}`" for c in omitted)
            + ".*",
        ]
    return "\n".join(lines)


def _records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _record_map(data: dict[str, Any]) -> bool:
    """Two or more flat dicts that share keys: one table, one row each."""
    if len(data) < 2 or not all(isinstance(v, dict) for v in data.values()):
        return False
    if any(isinstance(x, dict) or _records(x) for v in data.values() for x in v.values()):
        return False
    keys = [set(v) for v in data.values()]
    return all(any(k & other for other in keys if other is not k) for k in keys)


def json_markdown(data: Any, level: int = 5) -> str:
    """A JSON document as Markdown: lists of records and maps of similar records as
    tables, flat mappings as key/value tables, nested mappings under bold labels (not
    headings: a results page's table of contents shows the page's headings, not JSON keys)."""
    if _records(data):
        return _table(data)
    if not isinstance(data, dict):
        return f"```json\n{json.dumps(data, indent=2)}\n```"
    parts = []
    flat = {k: v for k, v in data.items() if not isinstance(v, dict) and not _records(v)}
    if flat:
        parts.append(_table([flat]))
    nested = {k: v for k, v in data.items() if k not in flat}
    if _record_map(nested):
        parts.append(_table(list(nested.values()), keys=list(nested)))
    else:
        for key, value in nested.items():
            # a bold label, not a heading: the page's table of contents lists its own headings only
            parts.append(f"**{key}**\n\n" + json_markdown(value, min(level + 1, 6)))
    return "\n\n".join(parts)


def _result_files() -> list[Path]:
    if not RESULTS_DIR.is_dir():
        return []
    return sorted(
        p for p in RESULTS_DIR.rglob("*") if p.is_file() and p.suffix.lower() in RESULT_SUFFIXES
    )


def _asset_uri(path: Path) -> str:
    return posixpath.join("results", "files", path.relative_to(RESULTS_DIR).as_posix())


def results_markdown(patterns: list[str], page_uri: str) -> str:
    matched = [
        p
        for p in _result_files()
        if any(fnmatch.fnmatch(p.relative_to(ROOT).as_posix(), pat) for pat in patterns)
    ]
    if not matched:
        shown = ", ".join(f"`{p}`" for p in patterns)
        return (
            '!!! note "Not generated yet"\n'
            f"    No file matching {shown} exists in this checkout, so there is nothing to show "
            "here yet. Run the command given on this page, commit what it writes, and rebuild the "
            "site: the results then appear here automatically.\n"
        )
    parts = []
    here = posixpath.dirname(page_uri)
    for path in matched:
        rel = path.relative_to(ROOT).as_posix()
        # a caption, not a heading: the table of contents shows the page's headings, not file paths
        parts.append(f'<p class="lightkv-results-file">From <code>{rel}</code>:</p>\n')
        suffix = path.suffix.lower()
        if suffix == ".json":
            try:
                parts.append(json_markdown(json.loads(path.read_text(encoding="utf-8"))))
            except json.JSONDecodeError as e:
                log.warning("lightkv_docs: %s is not valid JSON (%s)", rel, e)
                parts.append(f"*`{rel}` is not valid JSON: {e}*")
        elif suffix == ".csv":
            reader = csv.DictReader(io.StringIO(path.read_text(encoding="utf-8")))
            parts.append(_table(list(reader)))
        elif suffix == ".md":
            parts.append(path.read_text(encoding="utf-8"))
        else:
            parts.append(f"![{path.name}]({posixpath.relpath(_asset_uri(path), here)})")
        parts.append("")
    return "\n\n".join(parts)


def benchmarks_markdown() -> str:
    """The benchmark scripts under ``benchmarks/`` with the first paragraph of each docstring."""
    scripts = sorted((ROOT / "benchmarks").glob("*.py")) if (ROOT / "benchmarks").is_dir() else []
    if not scripts:
        return "*There are no benchmark scripts in `benchmarks/` yet.*\n"
    rows = ["| script | measures | command |", "|---|---|---|"]
    for path in scripts:
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        except SyntaxError:
            doc = ""
        summary = " ".join(doc.strip().split("\n\n")[0].split())
        rel = path.relative_to(ROOT).as_posix()
        rows.append(f"| `{rel}` | {_cell(summary)} | `.venv/bin/python {rel}` |")
    return "\n".join(rows) + "\n"


def results_files_markdown() -> str:
    files = _result_files()
    if not files:
        return "*`benchmarks/results/` holds no results in this checkout yet.*\n"
    return (
        "\n".join(
            f"- `{p.relative_to(ROOT).as_posix()}` ({p.stat().st_size:,} bytes)" for p in files
        )
        + "\n"
    )


# ---------------------------------------------------------------------------- hooks
_TREE: list[Module] | None = None
_MARKER = re.compile(r"<!--\s*lightkv:([a-z-]+)\s*(.*?)\s*-->")


def _discover_all() -> list[Module]:
    """The library's module tree, then the laboratory's (where this checkout has it)."""
    trees = [discover()]
    if (LAB_DIR / "__init__.py").is_file():
        trees.append(discover(LAB_DIR, LAB_PACKAGE))
    return trees


class _Trees:
    """The module trees, walked as one."""

    def __init__(self, trees: list[Module]):
        self.trees = trees

    def walk(self):
        for tree in self.trees:
            yield from tree.walk()


def _tree() -> _Trees:
    global _TREE
    if _TREE is None:
        _TREE = _discover_all()
    return _Trees(_TREE)


def on_config(config, **kwargs):
    global _TREE
    _TREE = _discover_all()  # re-read on every (re)build
    for item in config["nav"] or []:
        if isinstance(item, dict) and NAV_SECTION in item:
            section = item[NAV_SECTION]
            section[:] = [
                e
                for e in section
                if not (isinstance(e, dict) and (PACKAGE in e or LAB_PACKAGE in e))
            ]
            section.extend(_nav_entry(tree) for tree in _tree().trees)
            break
    else:
        log.warning(
            "lightkv_docs: the nav has no %r section for the generated reference pages", NAV_SECTION
        )
    return config


def on_files(files, config, **kwargs):
    # mkdocs is imported here, not at the top: the page generators above are plain
    # functions that the test suite calls without the docs extra installed.
    from mkdocs.structure.files import File

    modules = {m.name: m for m in _tree().walk()}
    for module in modules.values():
        files.append(File.generated(config, module.page, content=module_page(module, modules)))
    for path in _result_files():
        if path.suffix.lower() in (".png", ".svg"):
            files.append(File.generated(config, _asset_uri(path), abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files, **kwargs):
    def replace(match: re.Match) -> str:
        kind, arg = match.group(1), match.group(2)
        if kind == "presets":
            return presets_markdown(table_only=arg == "table")
        if kind == "modules":
            here = posixpath.dirname(page.file.src_uri)
            rows = ["| module | summary |", "|---|---|"]
            for m in _tree().walk():
                rows.append(
                    f"| [`{m.name}`]({posixpath.relpath(m.page, here)}) | {_cell(m.summary())} |"
                )
            return "\n".join(rows) + "\n"
        if kind == "results":
            return results_markdown(arg.split(), page.file.src_uri)
        if kind == "families":
            return families_markdown(page.file.src_uri)
        if kind == "benchmarks":
            return benchmarks_markdown()
        if kind == "results-files":
            return results_files_markdown()
        log.warning("lightkv_docs: unknown marker 'lightkv:%s' in %s", kind, page.file.src_uri)
        return match.group(0)

    return _MARKER.sub(replace, markdown)
