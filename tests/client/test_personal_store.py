"""A node's personal state on its own disk: round trip, absent before the first round, unreadable refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quorumfl.client.personal_store import PersonalStore
from quorumfl.errors import DataError


def test_round_trip_and_overwrite(tmp_path: Path) -> None:
    store = PersonalStore(tmp_path / "node")
    assert store.load("7") is None
    store.save("7", {"5.weight": np.ones((2, 3), np.float32)})
    store.save("7", {"5.weight": np.full((2, 3), 2, np.float32), "5.bias": np.zeros(2, np.float32)})
    loaded = store.load("7")
    assert loaded is not None and set(loaded) == {"5.weight", "5.bias"}
    np.testing.assert_array_equal(loaded["5.weight"], np.full((2, 3), 2, np.float32))
    assert [p.name for p in (tmp_path / "node").iterdir()] == ["personal-7.npz"]  # no temporary file left


def test_unreadable_state_and_odd_run_keys_are_refused(tmp_path: Path) -> None:
    store = PersonalStore(tmp_path)
    (tmp_path / "personal-3.npz").write_bytes(b"not an npz")
    with pytest.raises(DataError, match="unreadable"):
        store.load("3")
    with pytest.raises(DataError, match="not a plain name"):
        store.save("../x", {})
