"""The tabular task's encoding of a batch of rows (``table_batches.Batch``), column at a time.

A numeric cell becomes its value scaled by the schema's declared range to [0, 1]; a categorical
cell sets the one-hot slot of the bucket its value hashes to (CRC-32 of column and value); the
label becomes a class index, or the target scaled by ``target_range``. pyarrow's compute kernels
trim and convert the cells; a categorical column is hashed once per distinct value. A cell that
the fast path does not take is read as ``tables.parse_number`` reads it (Python's ``float``), so the
accepted values and every refusal (empty, text, NaN, out of range: one line naming the row and the
column) are those of a whole table, and a file encodes the same in one batch or in many.

A feature column the schema marks ``"missing": true`` may have empty cells. A numeric one then adds
an indicator feature (1 where the cell was empty; after all the numeric columns, before the
categorical buckets) and its empty cells take the middle of the declared range, so the model can
tell a filled-in cell from a real one; a categorical one counts the empty cell as one more value.
Without the mark an empty cell is refused, naming the row, the column and the mark. A label is never
missing.
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

__all__ = ["bucket", "encode_batch", "feature_count", "numeric_count"]


def bucket(column: str, value: str, buckets: int) -> int:
    return zlib.crc32(f"{column}\x1f{value}".encode()) % buckets


def numeric_count(schema: Schema) -> int:
    """The features before the categorical buckets: the numeric columns and their missing indicators."""
    return len(schema["numeric"]) + sum(bool(c.get("missing")) for c in schema["numeric"])


def feature_count(schema: Schema) -> int:
    return numeric_count(schema) + sum(int(c["buckets"]) for c in schema["categorical"])


def _trimmed(batch: Batch, spec: Schema) -> tuple[Any, NDArray[np.bool_]]:
    """A feature column's cells, trimmed, and where they are empty (or null); an empty cell is refused,
    naming its row, unless the schema marks the column ``"missing": true``."""
    import pyarrow.compute as pc

    trimmed = pc.utf8_trim_whitespace(batch.column(spec["name"]))
    empty = np.asarray(pc.fill_null(pc.equal(trimmed, ""), True), dtype=bool)
    if empty.any() and not spec.get("missing"):
        row = batch.first + int(np.flatnonzero(empty)[0]) + 1
        raise DataError(f"{batch.path}: row {row}, column '{spec['name']}' is empty; fill it in, drop the row, or mark "
                        "the column \"missing\": true in the schema ('quorumfl data schema' does where it sees empty "
                        "cells)")
    return trimmed, empty


def _filled(batch: Batch, spec: Schema) -> Any:
    """A categorical column's cells, trimmed (an allowed empty cell is the value "")."""
    import pyarrow.compute as pc

    trimmed, _ = _trimmed(batch, spec)
    return pc.fill_null(trimmed, "")


def _numeric_feature(batch: Batch, spec: Schema) -> tuple[NDArray[np.float32], NDArray[np.bool_]]:
    """A numeric feature scaled to [0, 1] (an allowed empty cell: 0.5) and where its cells were empty."""
    import pyarrow as pa
    import pyarrow.compute as pc

    low, high = float(spec["low"]), float(spec["high"])
    cells, empty = _trimmed(batch, spec)
    if empty.any():
        cells = pc.if_else(pa.array(empty), pa.scalar(repr((low + high) / 2)), cells)
    return ((_numbers(batch, spec["name"], low, high, cells=cells) - low) / (high - low)).astype(np.float32), empty


def _numbers(batch: Batch, name: str, low: float, high: float, *, label: bool = False,
             cells: Any = None) -> NDArray[np.float64]:
    """The column (or ``cells``) as floats within [low, high] (``parse_number``'s rules, row numbers of
    the file)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    cells = batch.column(name) if cells is None else cells
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
    offset = len(schema["numeric"])  # then one indicator per numeric column that may be missing
    for j, spec in enumerate(schema["numeric"]):
        x[:, j], empty = _numeric_feature(batch, spec)
        if spec.get("missing"):
            x[:, offset] = empty
            offset += 1
    rows = np.arange(batch.rows)
    for spec in schema["categorical"]:
        buckets = int(spec["buckets"])
        encoded = pc.dictionary_encode(_filled(batch, spec))
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
