"""The ``text`` task: short documents (citizen requests, service-log entries, document glosses) → a class.

Schema::

    {"task": "text", "version": "1", "text": "request", "label": "department", "classes": [...],
     "buckets": 8192, "dim": 32, "max_tokens": 128, "word_ngrams": 2, "char_ngrams": 3,
     "ignore": [...]}

No tokenizer and no pretrained weights: a document becomes the ids of its hashed word unigrams,
word bigrams (``word_ngrams`` = 2) and character n-grams of each word (``char_ngrams``; 0 = none),
truncated to ``max_tokens`` and padded with 0; the ``fasttext`` model averages their embeddings
(``quorumfl.core.tasks.modules.HashedBag``). Hashing is CRC-32 into ``buckets − 1`` ids, the same on
every node and every platform, so no vocabulary is collected from any department.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.tasks.base import Schema
from quorumfl.core.tasks.objective import CLASSIFICATION, Objective
from quorumfl.core.tasks.tables import Table, class_indices, read_table
from quorumfl.errors import ConfigError, DataError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["TextTask", "encode_texts", "token_ids"]

_WORD = re.compile(r"\w+", re.UNICODE)
DEFAULTS: dict[str, int] = {"buckets": 8192, "dim": 32, "max_tokens": 128, "word_ngrams": 2, "char_ngrams": 3}
MAX_CLASSES = 1000


def token_ids(text: str, schema: Schema) -> list[int]:
    """The hashed n-gram ids of one document (1 … buckets − 1), at most ``max_tokens``."""
    buckets, limit = int(schema["buckets"]), int(schema["max_tokens"])
    words = _WORD.findall(text.lower())
    grams = [f"w {w}" for w in words]
    if int(schema["word_ngrams"]) >= 2:
        grams += [f"b {a} {b}" for a, b in zip(words, words[1:], strict=False)]
    n = int(schema["char_ngrams"])
    if n > 0:
        for word in words:
            padded = f"<{word}>"
            grams += [f"c {padded[i:i + n]}" for i in range(max(1, len(padded) - n + 1))]
    return [1 + zlib.crc32(g.encode()) % (buckets - 1) for g in grams[:limit]]


def encode_texts(table: Table, schema: Schema) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Token ids (N, max_tokens) int64 and class indices (N,)."""
    path, text, label = table.path, schema["text"], schema["label"]
    table.check_columns([text, label], ignored=schema.get("ignore", []))
    x = np.zeros((table.rows, int(schema["max_tokens"])), dtype=np.int64)
    for row, cell in enumerate(table.column(text)):
        ids = token_ids(cell or "", schema)
        if not ids:
            raise DataError(f"{path}: row {row + 1}, column '{text}' has no words; fill it in or drop the row")
        x[row, : len(ids)] = ids
    return x, class_indices(path, label, table.column(label), schema["classes"])


class TextTask:
    """Text classification with a hashed n-gram embedding bag."""

    name = "text"
    version = "1"
    default_model = "fasttext"
    # Adam: the sparse embedding bag's rare n-grams get steps SGD's single rate starves
    training_defaults = ("adam", 0.01)
    needs_statistics = False

    def model_names(self) -> Sequence[str]:
        return ("fasttext",)

    def check_schema(self, schema: Schema) -> None:
        def need(ok: bool, field: str, fix: str) -> None:
            if not ok:
                raise ConfigError(f"text schema: '{field}' {fix}")

        need(schema.get("task") == self.name, "task", "must be 'text'")
        need(str(schema.get("version")) == self.version, "version", f"must be '{self.version}' for this QuorumFL")
        for field in ("text", "label"):
            need(isinstance(schema.get(field), str) and bool(schema.get(field)), field, "must name a column")
        need(schema.get("text") != schema.get("label"), "label", "must differ from the text column")
        classes = schema.get("classes")
        need(isinstance(classes, list) and 2 <= len(classes) <= MAX_CLASSES and len(set(map(str, classes))) == len(classes),
             "classes", f"must list 2 to {MAX_CLASSES} distinct classes")
        bounds = {"buckets": (16, 1 << 22), "dim": (2, 1024), "max_tokens": (1, 4096), "word_ngrams": (1, 2),
                  "char_ngrams": (0, 6)}
        for field, (low, high) in bounds.items():
            value = schema.get(field)
            need(isinstance(value, int) and not isinstance(value, bool) and low <= value <= high, field,
                 f"must be an integer from {low} to {high}")

    def input_shape(self, schema: Schema) -> tuple[int, ...]:
        return (int(schema["max_tokens"]),)

    def outputs(self, schema: Schema) -> int:
        return len(schema["classes"])

    def objective(self, schema: Schema) -> Objective:
        return CLASSIFICATION

    def build_model(self, model: str, schema: Schema, *, seed: int) -> nn.Module:
        from quorumfl.core.tasks.modules import HashedBag, seeded

        if model != "fasttext":
            raise ConfigError(f"model: the text task has no model '{model}'; choose one of {list(self.model_names())}")
        return seeded(lambda: HashedBag(int(schema["buckets"]), int(schema["dim"]), self.outputs(schema)), seed)

    def infer_schema(self, source: Path, options: Mapping[str, str]) -> dict[str, Any]:
        table = read_table(source)
        text, label = options.get("text", ""), options.get("label", "")
        if not text or not label:
            raise ConfigError(f"--text and --label: name the text and label columns of {source} "
                              f"(columns: {', '.join(table.columns)})")
        table.column(text)
        classes = sorted({(c or "").strip() for c in table.column(label)})
        if len(classes) < 2:
            raise DataError(f"{source}: label column '{label}' has only the class {classes!r}; a classifier needs two")
        schema: dict[str, Any] = {"task": self.name, "version": self.version, "text": text, "label": label,
                                  "classes": classes, "ignore": [c for c in table.columns if c not in (text, label)]}
        for field, default in DEFAULTS.items():
            schema[field] = int(options.get(field.replace("_", "-"), default))
        self.check_schema(schema)
        return schema

    def read(self, source: Path, schema: Schema) -> tuple[NDArray[Any], NDArray[Any]]:
        return encode_texts(read_table(source), schema)
