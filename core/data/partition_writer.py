"""A partition directory written a batch of rows at a time, in memory bounded by the batch.

``train.npz`` and ``test.npz`` are NumPy ``.npz`` archives as ``np.savez`` writes them (members
``x.npy`` and ``y.npy``; ``np.load`` reads them), built here by streaming: each batch's feature rows go
straight into the archive's ``x.npy`` member, whose header already holds the final shape (the rows
were counted when the file was checked), its targets into a side file that becomes ``y.npy`` at the
end. The members are deflated (level 1): a table's one-hot columns are mostly zeros, and the
partition is then about the size the data needs rather than four bytes a slot. ``partition.json``
goes last, as ``store.write_partition`` writes it. NumPy has no incremental ``savez``, hence this.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.tasks.base import TestRows

__all__ = ["PartitionWriter"]

COPY_BYTES = 1 << 20


class _Split:
    """One archive (train or test): its ``x.npy`` member open for rows, its targets on the side."""

    def __init__(self, path: Path, rows: int, shape: tuple[int, ...], x_dtype: np.dtype[Any],
                 y_dtype: np.dtype[Any]) -> None:
        self.path, self.rows, self.written, self.x_dtype, self.y_dtype = path, rows, 0, x_dtype, y_dtype
        self.archive = zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1, allowZip64=True)
        self.x: IO[bytes] = self.archive.open("x.npy", "w", force_zip64=True)
        _header(self.x, (rows, *shape), x_dtype)
        self.y_path = path.with_suffix(".y.tmp")
        self.y: IO[bytes] = open(self.y_path, "wb")  # noqa: SIM115  (closed in finish)

    def add(self, x: NDArray[Any], y: NDArray[Any]) -> None:
        self.x.write(np.ascontiguousarray(x, dtype=self.x_dtype).tobytes())
        self.y.write(np.ascontiguousarray(y, dtype=self.y_dtype).tobytes())
        self.written += len(y)

    def finish(self) -> None:
        if self.written != self.rows:
            raise RuntimeError(f"{self.path}: {self.written} rows written, {self.rows} counted")
        self.x.close()
        self.y.close()
        with self.archive.open("y.npy", "w", force_zip64=True) as member, open(self.y_path, "rb") as side:
            _header(member, (self.rows,), self.y_dtype)
            shutil.copyfileobj(side, member, COPY_BYTES)
        self.archive.close()
        self.y_path.unlink()


def _header(out: IO[bytes], shape: tuple[int, ...], dtype: np.dtype[Any]) -> None:
    np.lib.format.write_array_header_2_0(out, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                               "shape": shape})


class PartitionWriter:
    """Rows of one department's file, in file order, into ``train.npz`` and ``test.npz`` of
    ``directory``; ``test`` says which rows of the file are test rows; ``shape``: one example's
    input shape."""

    def __init__(self, directory: Path, test: TestRows, shape: tuple[int, ...], y_dtype: Any) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.test, self.shape, self.y_dtype, self.at = directory, test, shape, np.dtype(y_dtype), 0
        self.splits: tuple[_Split, _Split] | None = None  # opened at the first rows: their dtype is the task's
        self.train_labels: NDArray[np.int64] | None = None

    def add(self, x: NDArray[Any], y: NDArray[Any]) -> None:
        """The file's next rows (encoded)."""
        if self.splits is None:
            self.splits = (_Split(self.directory / "train.npz", self.test.count - self.test.test, self.shape, x.dtype,
                                  self.y_dtype),
                           _Split(self.directory / "test.npz", self.test.test, self.shape, x.dtype, self.y_dtype))
        train, test = self.splits
        marks = self.test.mask(self.at, self.at + len(y))
        self.at += len(y)
        train.add(x[~marks], y[~marks])
        test.add(x[marks], y[marks])
        if np.issubdtype(y.dtype, np.integer):  # classification: the train split's label counts
            counts = np.bincount(y[~marks].astype(np.int64))
            if self.train_labels is None:
                self.train_labels = counts
            else:
                size = max(len(counts), len(self.train_labels))
                self.train_labels = np.pad(self.train_labels, (0, size - len(self.train_labels))) + np.pad(
                    counts, (0, size - len(counts)))

    def finish(self) -> tuple[int, int]:
        """Close both archives; (train rows, test rows)."""
        if self.splits is None:
            raise RuntimeError(f"{self.directory}: no rows were written")
        for split in self.splits:
            split.finish()
        return self.splits[0].rows, self.splits[1].rows
