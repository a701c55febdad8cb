"""Rendering for the CLI: Rich tables for people, ``--format json`` for scripts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["Format", "console", "err_console", "print_json", "table"]

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


def table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> Table:
    out = Table(title=title, title_justify="left")
    for column in columns:
        out.add_column(column.replace("_", " "))
    for row in rows:
        out.add_row(*(_cell(row.get(c)) for c in columns))
    return out
