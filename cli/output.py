"""Rendering for the CLI: Rich tables for people, ``--format json`` for scripts."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from quorumfl.errors import ConfigError

__all__ = ["Format", "OpenOpt", "OutOpt", "ReportFormat", "ReportFormatOpt", "console", "emit_report", "err_console",
           "print_json", "short_time", "table", "write_page"]

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


# Columns a reader finds rows by: shown whole whatever the console's width.
WHOLE = frozenset({"id", "status", "round", "run", "version", "node", "department", "node_id"})
# Short cells (numbers, times) are not broken either; longer text wraps at word boundaries.
SHORT_CELL = 12


def table(title: str, rows: Sequence[dict[str, Any]], columns: Sequence[str], *,
          optional: Sequence[str] = (), width: int | None = None) -> Table:
    """A table that fits the console (``width``, default the console's): the ``optional`` columns (those
    of them in ``columns``) are left out, last first, until the rest fits; if it still does not fit,
    long text wraps at word boundaries, while ids, statuses (``WHOLE``), numbers and headers stay whole."""
    cells = [{c: _cell(row.get(c)) for c in columns} for row in rows]
    shown = list(columns)
    limit = width or console.width

    def longest(name: str) -> int:
        return max([len(r[name]) for r in cells], default=0)

    def needed(names: Sequence[str]) -> int:  # Rich's default box: 3 characters per column, plus 1
        return 1 + sum(3 + max(len(n.replace("_", " ")), longest(n)) for n in names)

    for name in reversed([o for o in optional if o in shown]):  # those a given table has
        if needed(shown) <= limit:
            break
        shown.remove(name)
    out = Table(title=title, title_justify="left", width=None if needed(shown) <= limit else limit)
    for column in shown:
        header = column.replace("_", " ")
        cell = longest(column)
        whole = column in WHOLE or cell <= SHORT_CELL
        floor = max([len(w) for w in header.split()] + [cell if whole else 0])
        out.add_column(header, no_wrap=whole, overflow="fold", min_width=floor)
    for row in cells:
        out.add_row(*(row[c] for c in shown))
    return out


class ReportFormat(StrEnum):
    """A report page's format: one HTML file, or the same data as JSON on stdout."""

    HTML = "html"
    JSON = "json"


OutOpt = Annotated[Path, typer.Option("--out", help="Folder for the HTML page (made if missing).")]
ReportFormatOpt = Annotated[ReportFormat, typer.Option("--format", help="html: one self-contained page; json: "
                                                       "the same data on stdout, nothing written.")]
OpenOpt = Annotated[bool, typer.Option("--open", help="Open the page in the default browser.")]


def emit_report(data: dict[str, Any], fmt: ReportFormat, out: Path, name: str, render: Callable[[], str], *,
                open_page: bool) -> None:
    """A report command's output: ``data`` as JSON on stdout, or the page ``render`` makes, written as
    ``out/name``."""
    if fmt is ReportFormat.JSON:
        print_json(data)
        return
    write_page(out, name, render, open_page=open_page)


def write_page(out: Path, name: str, render: Callable[[], str], *, open_page: bool) -> None:
    """Write a report page into folder ``out`` (made if missing); an earlier page of that name is replaced
    whole or not at all."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for the report")
    out.mkdir(parents=True, exist_ok=True)
    page = out / name
    partial = page.with_name(f".{name}.partial")
    partial.write_text(render(), encoding="utf-8")
    partial.replace(page)
    console.print(f"report written to {page}")
    if open_page:
        import webbrowser

        webbrowser.open(page.resolve().as_uri())


@contextmanager
def file_progress() -> Iterator[Callable[[str, int, int], None]]:
    """A progress bar on a terminal's stderr for reading a large file, one line per stage
    (checking, importing); yields the callback that moves it: (stage, bytes read, file size)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        TimeRemainingColumn(), console=err_console, transient=True,
                        disable=not err_console.is_terminal)
    stages: dict[str, Any] = {}

    def hear(stage: str, done: int, size: int) -> None:
        if stage not in stages:
            stages[stage] = progress.add_task(stage, total=size)
        progress.update(stages[stage], completed=done)

    with progress:
        yield hear
