"""Versioned model files: written atomically, verified against their SHA-256 when loaded.

A model file is an ``.npz`` of named float arrays (no pickles). Writes go to a temporary file in the
same folder, are fsynced, renamed over the final name, and the folder is fsynced, so a crash leaves
either the old state or the complete new file, never a torn one.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from quorumfl.core.files import atomic_write
from quorumfl.errors import ModelStoreError

__all__ = ["ModelStore", "StoredModel"]

Arrays = dict[str, NDArray[np.generic]]


@dataclass(frozen=True)
class StoredModel:
    path: Path
    sha256: str
    size_bytes: int


def _serialize(arrays: Arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **arrays)
    return buffer.getvalue()


class ModelStore:
    """Model files under one root folder."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def save(self, arrays: Arrays, name: str) -> StoredModel:
        if not arrays:
            raise ModelStoreError("refusing to store a model with no parameter arrays")
        if "/" in name or name.startswith("."):
            raise ModelStoreError(f"invalid model file name '{name}'")
        payload = _serialize(arrays)
        digest = hashlib.sha256(payload).hexdigest()
        final = self.root / f"{name}.npz"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write(final, payload)
        except OSError as exc:
            raise ModelStoreError(f"cannot write model file {final}: {exc.strerror or exc}; check the run's "
                                  "model-dir (or the server's --home) and that it is a writable folder") from exc
        return StoredModel(final, digest, len(payload))

    @staticmethod
    def load(path: Path | str, sha256: str) -> Arrays:
        """Read a model file, refusing it unless its SHA-256 matches the recorded one."""
        path = Path(path)
        try:
            payload = path.read_bytes()
        except FileNotFoundError:
            raise ModelStoreError(f"model file {path} is missing") from None
        except OSError as exc:
            raise ModelStoreError(f"cannot read model file {path}: {exc.strerror or exc}") from exc
        actual = hashlib.sha256(payload).hexdigest()
        if actual != sha256:
            raise ModelStoreError(
                f"model file {path} does not match its recorded SHA-256 (expected {sha256[:12]}…, "
                f"found {actual[:12]}…): it was modified or corrupted; roll back to another version "
                "with 'quorumfl models rollback'"
            )
        try:
            with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        except (OSError, ValueError) as exc:
            raise ModelStoreError(f"model file {path} is not a readable .npz ({exc})") from exc
