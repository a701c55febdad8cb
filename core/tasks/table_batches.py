"""A department's table read in batches of rows, with memory bounded whatever the file's size.

pyarrow's streaming CSV reader (``pyarrow.csv.open_csv``: C++, a block at a time) and Parquet's
``iter_batches`` read the rows; JSON lines are read a line at a time. Every batch holds the cells
as strings (``pyarrow`` string arrays; null for a JSON null), as ``tables.read_table`` gives them,
so a task encodes a batch exactly as it encodes a whole table, and every problem is the same one
``DataError`` line naming the file, the line or row and the fix (``tables`` writes the checks of
a header and of a Parquet column's type once, for both). ``on_bytes`` hears how far into the file
the reader is (for a progress bar); a file that changes while it is read is refused.

Written here because pyarrow reads but does not check: which header, which columns, which lines
are ragged, which byte is not UTF-8, what a cell is as text.
"""

from __future__ import annotations

import codecs
import csv
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from quorumfl.core.tasks.tables import (
    FORMATS,
    cell_text,
    check_header,
    check_parquet_type,
    file_error,
    json_record,
)
from quorumfl.errors import DataError

__all__ = ["Batch", "BATCH_BYTES", "file_batches"]

BATCH_BYTES = 1 << 20  # CSV bytes per batch: pyarrow holds about 20 times this at a time, whatever the file size
JSONL_ROWS = 20_000
PARQUET_ROWS = 65_536


@dataclass(frozen=True)
class Batch:
    """Consecutive data rows of ``path``: ``first`` (0-based) is the file's data row it starts at."""

    path: Path
    first: int
    columns: dict[str, Any]  # name → pyarrow string array (nulls for JSON nulls)
    rows: int

    def column(self, name: str) -> Any:
        try:
            return self.columns[name]
        except KeyError:
            raise DataError(f"{self.path}: no column '{name}' (columns: {', '.join(self.columns)}); rename the column "
                            "or fix the schema") from None

    def check_columns(self, expected: list[str], *, ignored: list[str]) -> None:
        """Refuse a missing column of ``expected`` or a column that is neither expected nor ignored."""
        for name in expected:
            self.column(name)
        extra = [c for c in self.columns if c not in expected and c not in ignored]
        if extra:
            raise DataError(f"{self.path}: column '{extra[0]}' is not in the schema; remove it from the file or list "
                            "it under 'ignore' in the schema")


def _open(path: Path) -> IO[bytes]:
    try:
        if path.is_dir():
            raise IsADirectoryError
        return open(path, "rb")  # noqa: SIM115  (closed by file_batches)
    except OSError as exc:
        raise file_error(path, exc) from None


def _first_bad_utf8_line(path: Path) -> int:
    """The line of the first byte that is not UTF-8 (read again, on the error path only)."""
    decoder, line = codecs.getincrementaldecoder("utf-8")(), 1
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as exc:
                return line + block[: exc.start].count(b"\n")
            line += block.count(b"\n")
    return line


def _csv_batches(path: Path, f: IO[bytes], size: int) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.csv as pacsv

    head = f.read(min(size, 1 << 20)).decode("utf-8-sig", errors="replace")
    f.seek(0)
    try:
        raw_names = next(csv.reader(io.StringIO(head, newline="")))
    except (StopIteration, csv.Error) as exc:
        raise DataError(f"{path}: no header row ({exc}); the first line must name the columns") from None
    names = check_header(path, raw_names)
    bad: list[str] = []

    def invalid(row: Any) -> str:
        if row.text.strip():
            if not bad:
                bad.append(f"{path}: line {row.number} has {row.actual_columns} fields, the header "
                           f"{row.expected_columns}; fix that line")
            return "error"
        return "skip"  # a line of blanks

    def refusal(exc: Exception) -> DataError:
        if bad:
            return DataError(bad[0])
        if "UTF8" in str(exc) or "UTF-8" in str(exc):
            return DataError(f"{path}: line {_first_bad_utf8_line(path)} is not UTF-8; re-save the file as UTF-8")
        return DataError(f"{path} is not valid CSV ({exc}); fix the quoting")

    try:
        reader = pacsv.open_csv(
            f, read_options=pacsv.ReadOptions(block_size=BATCH_BYTES, use_threads=False),
            parse_options=pacsv.ParseOptions(newlines_in_values=True, invalid_row_handler=invalid),
            convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in raw_names},
                                                 strings_can_be_null=False, quoted_strings_can_be_null=False))
    except pa.ArrowInvalid as exc:
        raise refusal(exc) from None
    first = 0
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            break
        except pa.ArrowInvalid as exc:
            raise refusal(exc) from None
        if batch.num_rows:
            yield Batch(path, first, dict(zip(names, batch.columns, strict=True)), batch.num_rows)
            first += batch.num_rows
    if first == 0:
        raise DataError(f"{path} has a header but no data rows")


def _jsonl_batches(path: Path, f: IO[bytes]) -> Iterator[Batch]:
    import pyarrow as pa

    keys: list[str] = []
    cells: dict[str, list[str | None]] = {}
    first = rows = 0
    lines = enumerate(io.TextIOWrapper(f, encoding="utf-8-sig", newline=""), start=1)
    while True:
        try:
            line, raw = next(lines)
        except StopIteration:
            break
        except UnicodeDecodeError:
            raise DataError(f"{path}: line {_first_bad_utf8_line(path)} is not UTF-8; re-save the file as UTF-8") from None
        if not raw.strip():
            continue
        record = json_record(path, line, raw, keys or None)
        if not keys:
            keys = list(record)
            cells = {k: [] for k in keys}
        for key, value in record.items():
            cells[key].append(value)
        rows += 1
        if rows == JSONL_ROWS:
            yield Batch(path, first, {k: pa.array(v, pa.string()) for k, v in cells.items()}, rows)
            first, rows, cells = first + rows, 0, {k: [] for k in keys}
    if rows:
        yield Batch(path, first, {k: pa.array(v, pa.string()) for k, v in cells.items()}, rows)
    elif first == 0:
        raise DataError(f"{path} holds no JSON objects")


def _parquet_batches(path: Path, f: IO[bytes]) -> Iterator[Batch]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(f)
        schema = parquet.schema_arrow
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path} is not a readable Parquet file ({exc}); export it again as Parquet") from None
    names = list(schema.names)
    if len(set(names)) != len(names):
        raise DataError(f"{path}: column '{next(n for n in names if names.count(n) > 1)}' appears twice; rename one "
                        "of them")
    for name in names:
        check_parquet_type(path, name, schema.field(name).type)
    first = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_ROWS):
        columns = {}
        for name, column in zip(names, batch.columns, strict=True):
            kind = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
            if pa.types.is_string(kind) or pa.types.is_large_string(kind):
                columns[name] = pc.cast(column, pa.string())
            elif pa.types.is_integer(kind) or pa.types.is_boolean(kind):
                columns[name] = pc.cast(column, pa.string())  # as JSON writes them: 12, true
            else:  # floats, decimals, dates: the cell string a CSV export would hold (tables.cell_text)
                columns[name] = pa.array([cell_text(v) for v in column.to_pylist()], pa.string())
        yield Batch(path, first, columns, batch.num_rows)
        first += batch.num_rows
    if first == 0:
        raise DataError(f"{path} has columns but no data rows")


def file_batches(path: Path, *, on_bytes: Callable[[int, int], None] | None = None) -> Iterator[Batch]:
    """The rows of ``path`` (``.csv``, ``.jsonl``/``.ndjson`` or ``.parquet``) in batches; ``on_bytes``
    gets (bytes read, file size) after each batch. Raises ``DataError`` naming the problem."""
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise DataError(f"{path}: unknown format '{suffix or '(none)'}'; give a .csv, .jsonl or .parquet file")
    f = _open(path)
    with f:
        before = os.fstat(f.fileno())
        if before.st_size == 0 or not f.read(1 << 16).strip():
            raise DataError(f"{path} is empty; export the department's table with a header row and data rows")
        f.seek(0)
        if suffix == ".csv":
            batches = _csv_batches(path, f, before.st_size)
        elif suffix == ".parquet":
            batches = _parquet_batches(path, f)
        else:
            batches = _jsonl_batches(path, f)
        for batch in batches:
            yield batch
            if on_bytes is not None:
                on_bytes(min(f.tell(), before.st_size), before.st_size)
        after = os.stat(path)
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            raise DataError(f"{path} changed while it was read; import it again once it is complete")
