"""The tabular task's encoding of a batch of rows (``table_batches.Batch``), column at a time.

A numeric cell becomes its value scaled by the schema's declared range to [0, 1]; a categorical
cell sets the one-hot slot of the bucket its value hashes to (CRC-32 of column and value); the
label becomes a class index, or the target scaled by ``target_range``. pyarrow's compute kernels
trim and convert the cells; a categorical column is hashed once per distinct value. A cell that
the fast path does not take is read as ``tables.parse_number`` reads it (Python's ``float``), so the
accepted values and every refusal (empty, text, NaN, out of range: one line naming the row and the
column) are those of a whole table, and a file encodes the same in one batch or in many.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.tasks.base import Schema
from quorumfl.core.tasks.table_batches import Batch
from quorumfl.core.tasks.tables import class_indices, parse_number
from quorumfl.errors import DataError

__all__ = ["bucket", "encode_batch", "feature_count"]


def bucket(column: str, value: str, buckets: int) -> int:
    return zlib.crc32(f"{column}\x1f{value}".encode()) % buckets


def feature_count(schema: Schema) -> int:
    return len(schema["numeric"]) + sum(int(c["buckets"]) for c in schema["categorical"])


def _filled(batch: Batch, name: str) -> Any:
    """A categorical column's cells, trimmed; refuses an empty (or null) cell naming its row."""
    import pyarrow.compute as pc

    trimmed = pc.utf8_trim_whitespace(batch.column(name))
    empty = np.asarray(pc.fill_null(pc.equal(trimmed, ""), True))
    if empty.any():
        row = batch.first + int(np.flatnonzero(empty)[0]) + 1
        raise DataError(f"{batch.path}: row {row}, column '{name}' is empty; fill it in (e.g. 'unknown') or drop the "
                        "row")
    return trimmed


def _numbers(batch: Batch, name: str, low: float, high: float, *, label: bool = False) -> NDArray[np.float64]:
    """The column as floats within [low, high] (``parse_number``'s rules, row numbers of the file)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    cells = batch.column(name)
    try:
        values = np.asarray(pc.cast(pc.utf8_trim_whitespace(cells), pa.float64()), dtype=np.float64)
        if not np.isfinite(values).all():
            raise ValueError("not finite")
    except (pa.ArrowException, ValueError):  # the exact rules and message: Python's float, cell by cell
        try:
            values = np.asarray(parse_number(batch.path, name, cells.to_pylist()), dtype=np.float64)
        except DataError as exc:
            raise DataError(_renumbered(str(exc), batch.first)) from None
    outside = np.flatnonzero((values < low) | (values > high))
    if outside.size:
        row = int(outside[0])
        kind, bounds = ("label column", "target_range") if label else ("column", "range")
        raise DataError(f"{batch.path}: row {batch.first + row + 1}, {kind} '{name}' is {values[row]:g}, outside the "
                        f"schema's {bounds} [{low:g}, {high:g}]; fix the value or widen the range in the schema")
    return values


def _renumbered(message: str, first: int) -> str:
    """A ``tables`` message about row r of a batch, about row ``first`` + r of the file."""
    head, sep, rest = message.partition(": row ")
    number, comma, tail = rest.partition(",")
    if not sep or not number.isdigit():
        return message
    return f"{head}: row {first + int(number)}{comma}{tail}"


def encode_batch(batch: Batch, schema: Schema) -> tuple[NDArray[np.float32], NDArray[Any]]:
    """Features (N, F) float32 and targets (int64 class indices, or float32 scaled to [0, 1])."""
    import pyarrow.compute as pc

    batch.check_columns([schema["label"], *(c["name"] for c in schema["numeric"]),
                         *(c["name"] for c in schema["categorical"])], ignored=list(schema.get("ignore", [])))
    x = np.zeros((batch.rows, feature_count(schema)), dtype=np.float32)
    for j, spec in enumerate(schema["numeric"]):
        low, high = float(spec["low"]), float(spec["high"])
        x[:, j] = ((_numbers(batch, spec["name"], low, high) - low) / (high - low)).astype(np.float32)
    offset = len(schema["numeric"])
    rows = np.arange(batch.rows)
    for spec in schema["categorical"]:
        buckets = int(spec["buckets"])
        encoded = pc.dictionary_encode(_filled(batch, spec["name"]))
        slots = np.array([bucket(spec["name"], v, buckets) for v in encoded.dictionary.to_pylist()], dtype=np.int64)
        x[rows, offset + slots[np.asarray(encoded.indices, dtype=np.int64)]] = 1.0
        offset += buckets
    label = schema["label"]
    if schema["objective"] == "classification":
        encoded = pc.dictionary_encode(pc.utf8_trim_whitespace(batch.column(label)))
        values = [str(v) for v in encoded.dictionary.to_pylist()]
        codes = np.asarray(encoded.indices.fill_null(len(values)), dtype=np.int64)  # null: no class
        known = {str(c) for c in schema["classes"]}
        unknown = np.array([v not in known for v in values] + [True])[codes]
        if unknown.any():
            row = int(np.flatnonzero(unknown)[0])
            key = values[codes[row]] if codes[row] < len(values) else ""
            raise DataError(f"{batch.path}: row {batch.first + row + 1}, label column '{label}' has class {key!r}, "
                            "which is not in the schema's classes; fix the value or add the class to the schema")
        return x, class_indices(batch.path, label, values, schema["classes"])[codes]
    low, high = (float(v) for v in schema["target_range"])
    target = _numbers(batch, label, low, high, label=True)
    return x, ((target - low) / (high - low)).astype(np.float32)
