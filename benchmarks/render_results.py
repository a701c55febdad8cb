"""The documentation's results page (``docs/results.md``), rendered from ``benchmarks/results/*.json``.

Each benchmark's latest result is a JSON file: ``benchmark``, ``command``, ``commit``, ``date``,
``machine`` and ``result`` (the ``--json`` line the benchmark printed). The page shows, per file, what
the benchmark measures (the first paragraph of its module docstring), how the result was obtained,
and its figures: scalars in a table, per-seed and per-round lists inline, lists of records (a
benchmark's ``datasets``) as tables of their own. ``python benchmarks/render_results.py --write``
rewrites the page; a test fails while it is out of date with the files.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PAGE = HERE.parent / "docs" / "results.md"

HEADER = """# Results

<!-- generated from benchmarks/results/*.json by `python benchmarks/render_results.py --write`; do not edit -->

The latest result of each benchmark in `benchmarks/`, as its `--json` line recorded it, with the
command, the commit and the machine it ran on. Run a benchmark with `--smoke` to check that it works
(the tests do), and without to measure; `benchmarks/README.md` describes each one and its keys.
Timings compare only within one result: each was measured in one run on one machine.
"""


def _summary(name: str) -> str:
    """The first paragraph of the benchmark module's docstring."""
    source = HERE / f"{name}.py"
    if not source.exists():
        return ""
    doc = ast.get_docstring(ast.parse(source.read_text())) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and all(isinstance(v, (int, float)) or v is None for v in value):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, (list, dict)):
        text = json.dumps(value, separators=(", ", ": "))
        return text if len(text) <= 160 else text[:157] + "…"
    return str(value).replace("|", "\\|")


def _records(key: str, rows: list[dict[str, Any]]) -> list[str]:
    columns = [c for c in rows[0] if all(not isinstance(r.get(c), (list, dict)) for r in rows)]
    lines = [f"`{key}`:", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_value(r.get(c)) for c in columns) + " |" for r in rows]
    return [*lines, ""]


def section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    name = data.get("benchmark", path.stem)
    lines = [f"## {name}", ""]
    if summary := _summary(name):
        lines += [summary, ""]
    lines += [f"- command: `{data.get('command', '')}`", f"- commit: `{data.get('commit', '')}`",
              f"- machine: {data.get('machine', '')}", ""]
    result: dict[str, Any] = data["result"]
    scalars = {k: v for k, v in result.items()
               if not (isinstance(v, list) and v and all(isinstance(r, dict) for r in v))}
    if scalars:
        lines += ["| key | value |", "|---|---|"] + [f"| `{k}` | {_value(v)} |" for k, v in scalars.items()] + [""]
    for key, value in result.items():
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            lines += _records(key, value)
    return lines


def render() -> str:
    lines = [HEADER]
    for path in sorted(RESULTS.glob("*.json")):
        lines += section(path)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        print("usage: python benchmarks/render_results.py --write", file=sys.stderr)
        sys.exit(64)
    text = render()
    if not PAGE.exists() or PAGE.read_text() != text:
        PAGE.write_text(text)
        print(f"rewrote {PAGE}")
