"""Reading a department's CSV, JSONL or Parquet file into checked rows (the tabular and text tasks' input).

Python's ``csv`` and ``json`` modules and pyarrow's Parquet reader read the rows; what is written
here is the checking that a department's file gets before anything is stored: UTF-8, a header, no
empty file, the columns the schema names (and no others), column types a table can hold, and a file
that does not change while it is read. Every problem is one ``DataError`` line naming the file, the
row or column, and the fix. Every format becomes the same ``Table`` of cell strings, so the tasks
parse and check a Parquet column exactly as they do a CSV one.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.files import FileChangedError, read_unchanged
from quorumfl.errors import DataError

__all__ = ["FORMATS", "Table", "cell_text", "check_header", "check_parquet_type", "class_indices", "file_error",
           "json_record",
           "parse_number", "read_table"]

FORMATS = (".csv", ".jsonl", ".ndjson", ".parquet")


@dataclass(frozen=True)
class Table:
    """Columns by name, each a list of cell strings (None for a JSON null), in row order."""

    path: Path
    columns: dict[str, list[str | None]]
    rows: int

    def column(self, name: str) -> list[str | None]:
        try:
            return self.columns[name]
        except KeyError:
            raise DataError(
                f"{self.path}: no column '{name}' (columns: {', '.join(self.columns)}); rename the column or "
                "fix the schema"
            ) from None

    def check_columns(self, expected: Iterable[str], *, ignored: Iterable[str] = ()) -> None:
        """Refuse a missing column of ``expected`` or a column that is neither expected nor ignored."""
        wanted, skip = list(expected), set(ignored)
        for name in wanted:
            self.column(name)
        extra = [c for c in self.columns if c not in wanted and c not in skip]
        if extra:
            raise DataError(
                f"{self.path}: column '{extra[0]}' is not in the schema; remove it from the file or list it "
                "under 'ignore' in the schema"
            )


def file_error(path: Path, exc: OSError) -> DataError:
    """The one line for a department's file that cannot be opened."""
    if isinstance(exc, FileNotFoundError):
        return DataError(f"{path} does not exist; pass the department's CSV, JSONL or Parquet file")
    if isinstance(exc, IsADirectoryError):
        return DataError(f"{path} is a folder; pass the department's CSV, JSONL or Parquet file")
    return DataError(f"cannot read {path}: {exc.strerror or exc}")


def _bytes(path: Path) -> bytes:
    try:
        raw = read_unchanged(path)
    except FileChangedError:
        raise DataError(f"{path} changed while it was read; import it again once it is complete") from None
    except OSError as exc:
        raise file_error(path, exc) from None
    if not raw.strip():
        raise DataError(f"{path} is empty; export the department's table with a header row and data rows")
    return raw


def _text(path: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line} is not UTF-8; re-save the file as UTF-8") from None


def check_header(path: Path, header: list[str]) -> list[str]:
    """A CSV header's column names (stripped): every column named, no name twice."""
    names = [h.strip() for h in header]
    if any(not n for n in names):
        raise DataError(f"{path}: column {names.index('') + 1} of the header has no name; name every column")
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise DataError(f"{path}: column '{dup}' appears twice in the header; rename one of them")
    return names


def _csv(path: Path, text: str) -> Table:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader)
    except (StopIteration, csv.Error) as exc:
        raise DataError(f"{path}: no header row ({exc}); the first line must name the columns") from None
    names = check_header(path, header)
    columns: dict[str, list[str | None]] = {n: [] for n in names}
    rows = 0
    try:
        for line, record in enumerate(reader, start=2):
            if not record or (len(record) == 1 and not record[0].strip()):
                continue  # a blank line
            if len(record) != len(names):
                raise DataError(f"{path}: line {line} has {len(record)} fields, the header {len(names)}; fix that line")
            for name, cell in zip(names, record, strict=True):
                columns[name].append(cell)
            rows += 1
    except csv.Error as exc:
        raise DataError(f"{path}: line {reader.line_num} is not valid CSV ({exc}); fix the quoting") from None
    if rows == 0:
        raise DataError(f"{path} has a header but no data rows")
    return Table(path, columns, rows)


def json_record(path: Path, line: int, raw: str, keys: list[str] | None) -> dict[str, str | None]:
    """One JSON-lines record as cell strings (None for null); its keys must be ``keys`` (those of
    line 1) when given."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: line {line} is not JSON ({exc.msg}); one JSON object per line") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}: line {line} is not a JSON object; one object per line")
    if keys is not None and set(record) != set(keys):
        missing = sorted(set(keys) - set(record)) or sorted(set(record) - set(keys))
        raise DataError(f"{path}: line {line} has other keys than line 1 ({missing[0]!r}); give every line the same "
                        "keys")
    cells: dict[str, str | None] = {}
    for key, value in record.items():
        if isinstance(value, (dict, list)):
            raise DataError(f"{path}: line {line}, key '{key}' holds a {type(value).__name__}; give a string or a "
                            "number")
        cells[str(key)] = None if value is None else value if isinstance(value, str) else json.dumps(value)
    return cells


def _jsonl(path: Path, text: str) -> Table:
    columns: dict[str, list[str | None]] = {}
    rows = 0
    for line, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        record = json_record(path, line, raw, list(columns) if rows else None)
        if rows == 0:
            columns = {k: [] for k in record}
        for key, value in record.items():
            columns[key].append(value)
        rows += 1
    if rows == 0:
        raise DataError(f"{path} holds no JSON objects")
    return Table(path, columns, rows)


def cell_text(value: object) -> str | None:
    """A Parquet value as the cell string a CSV would hold (numbers as JSON writes them: NaN stays NaN)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    return str(value)  # decimals


def check_parquet_type(path: Path, name: str, kind: Any) -> None:
    """Refuse a Parquet column whose type a table cell cannot hold (lists, structs, binary…)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
            or pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_decimal(kind)
            or pa.types.is_temporal(kind)):
        raise DataError(f"{path}: column '{name}' has Parquet type {kind}; give numbers, text, booleans or "
                        "dates, or drop the column")


def _parquet(path: Path, raw: bytes) -> Table:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        data = pq.read_table(pa.BufferReader(raw))
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path} is not a readable Parquet file ({exc}); export it again as Parquet") from None
    columns: dict[str, list[str | None]] = {}
    for name, column in zip(data.column_names, data.columns, strict=True):
        check_parquet_type(path, name, column.type)
        if name in columns:
            raise DataError(f"{path}: column '{name}' appears twice; rename one of them")
        columns[name] = [cell_text(v) for v in column.to_pylist()]
    if data.num_rows == 0:
        raise DataError(f"{path} has columns but no data rows")
    return Table(path, columns, data.num_rows)


def read_table(path: Path) -> Table:
    """Read ``path`` (``.csv``, ``.jsonl``/``.ndjson`` or ``.parquet``) into a ``Table``."""
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise DataError(f"{path}: unknown format '{suffix or '(none)'}'; give a .csv, .jsonl or .parquet file")
    raw = _bytes(path)
    if suffix == ".parquet":
        return _parquet(path, raw)
    text = _text(path, raw)
    return _csv(path, text) if suffix == ".csv" else _jsonl(path, text)


def class_indices(path: Path, column: str, values: Sequence[str | None], classes: Sequence[object]) -> NDArray[np.int64]:
    """The cells of a label column as indices into the schema's ``classes``; refuses an unknown class."""
    index = {str(c): i for i, c in enumerate(classes)}
    out = np.empty(len(values), dtype=np.int64)
    for row, cell in enumerate(values):
        key = "" if cell is None else cell.strip()
        if key not in index:
            raise DataError(f"{path}: row {row + 1}, label column '{column}' has class {key!r}, which is not in the "
                            "schema's classes; fix the value or add the class to the schema")
        out[row] = index[key]
    return out


def parse_number(path: Path, column: str, values: Sequence[str | None]) -> list[float]:
    """The cells of a numeric column as floats; refuses an empty cell, text, NaN or infinity."""
    out: list[float] = []
    for row, cell in enumerate(values, start=1):
        where = f"{path}: row {row}, column '{column}'"
        if cell is None or not cell.strip():
            raise DataError(f"{where} is empty; fill it in or drop the row")
        try:
            value = float(cell)
        except ValueError:
            raise DataError(f"{where}: {cell!r} is not a number (the column is numeric); fix the value or declare "
                            "the column categorical") from None
        if not math.isfinite(value):
            raise DataError(f"{where} is {cell.strip()}; give a finite number or drop the row")
        out.append(value)
    return out
