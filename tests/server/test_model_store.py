"""Model files: atomic write, hash verification, tamper detection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quorumfl.errors import ModelStoreError
from quorumfl.server.model_store import ModelStore


def test_round_trip(tmp_path: Path) -> None:
    arrays = {"0.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "0.bias": np.ones(2, np.float32)}
    stored = ModelStore(tmp_path).save(arrays, "run1-round0001")
    assert stored.path == tmp_path / "run1-round0001.npz" and stored.size_bytes == stored.path.stat().st_size
    loaded = ModelStore.load(stored.path, stored.sha256)
    assert set(loaded) == set(arrays)
    for key in arrays:
        np.testing.assert_array_equal(loaded[key], arrays[key])
    assert not list(tmp_path.glob("*.tmp"))  # no temp file left behind


def test_flipped_byte_is_refused(tmp_path: Path) -> None:
    stored = ModelStore(tmp_path).save({"w": np.zeros(100, np.float32)}, "m")
    data = bytearray(stored.path.read_bytes())
    data[len(data) // 2] ^= 0x01
    stored.path.write_bytes(bytes(data))
    with pytest.raises(ModelStoreError, match="does not match its recorded SHA-256"):
        ModelStore.load(stored.path, stored.sha256)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError, match="missing"):
        ModelStore.load(tmp_path / "gone.npz", "0" * 64)


def test_overwrite_keeps_a_complete_file(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    first = store.save({"w": np.zeros(3, np.float32)}, "m")
    second = store.save({"w": np.ones(3, np.float32)}, "m")
    assert first.sha256 != second.sha256
    np.testing.assert_array_equal(ModelStore.load(second.path, second.sha256)["w"], np.ones(3))


def test_bad_names_and_empty_models(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError, match="no parameter arrays"):
        ModelStore(tmp_path).save({}, "m")
    with pytest.raises(ModelStoreError, match="invalid model file name"):
        ModelStore(tmp_path).save({"w": np.zeros(1)}, "../escape")
