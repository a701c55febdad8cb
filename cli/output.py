"""Rendering for the CLI: Rich tables for people, ``--format json`` for scripts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["Format", "console", "err_console", "print_json", "short_time", "table"]

console = Console()
err_console = Console(stderr=True)


class Format(StrEnum):
    TABLE = "table"
    JSON = "json"


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.4f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value)
    return str(value)


def short_time(value: Any) -> str | None:
    """An ISO timestamp as 'MM-DD HH:MM' (a table cell); the full value stays in --format json."""
    if not value:
        return None
    text = str(value)
    return f"{text[5:10]} {text[11:16]}" if len(text) >= 16 and text[10] in "T " else text


def table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str], *,
          optional: Sequence[str] = (), width: int | None = None) -> Table:
    """A table whose rows stay one line each: the ``optional`` columns (a subset of ``columns``) are
    left out, last first, until the rest fits the console (``width``, default the console's)."""
    cells = [{c: _cell(row.get(c)) for c in columns} for row in rows]
    shown = list(columns)
    limit = width or console.width

    def needed(names: Sequence[str]) -> int:  # Rich's default box: 3 characters per column, plus 1
        return 1 + sum(3 + max([len(n.replace("_", " "))] + [len(r[n]) for r in cells]) for n in names)

    for name in reversed(list(optional)):
        if needed(shown) <= limit:
            break
        shown.remove(name)
    out = Table(title=title, title_justify="left")
    for column in shown:
        out.add_column(column.replace("_", " "), no_wrap=True, overflow="ellipsis")
    for row in cells:
        out.add_row(*(row[c] for c in shown))
    return out
