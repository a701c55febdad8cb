"""The node's key store: 0600 files, integrity checks, both ledgers survive a reload, the shares file is bound to its key."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from quorumfl.aggregation.ckks import Announcement, CkksParams, KeyParty
from quorumfl.errors import NotFoundError, SecureAggregationError
from quorumfl.privacy.keystore import KeyStore, StoredKey

from ..aggregation.test_ckks import run_ceremony

MEMBERS = (11, 12, 13)


@pytest.fixture(scope="module")
def share() -> object:
    return run_ceremony(MEMBERS, 2).shares[11]


def test_a_key_round_trips_with_its_ledger_and_only_the_owner_can_read_it(tmp_path: Path, share: object) -> None:
    store = KeyStore(tmp_path / "keys")
    store.save_key(StoredKey(share, run_id=5))  # type: ignore[arg-type]
    key_id = share.key_id  # type: ignore[attr-defined]
    path = store.directory / f"key-{key_id}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    shares_path = store.directory / f"key-{key_id}.shares"
    assert stat.S_IMODE(shares_path.stat().st_mode) == 0o600
    store.record_asked(key_id, 3, 0)
    store.record_encrypted(key_id, b"n" * 16)
    loaded = KeyStore(tmp_path / "keys").load_key(key_id)
    assert loaded.asked == {(3, 0)} and loaded.encrypted == {b"n" * 16} and loaded.run_id == 5
    assert np.array_equal(loaded.share.share, share.share)  # type: ignore[attr-defined]
    assert np.array_equal(loaded.share.secret, share.secret)  # type: ignore[attr-defined]
    assert np.array_equal(loaded.share.dealt, share.dealt)  # type: ignore[attr-defined]
    assert loaded.share.public_key == share.public_key and loaded.share.holders == MEMBERS  # type: ignore[attr-defined]
    assert store.keys() == [key_id]


def test_an_edited_or_exposed_key_file_is_refused_and_left_as_it_is(tmp_path: Path, share: object) -> None:
    store = KeyStore(tmp_path / "keys")
    store.save_key(StoredKey(share, run_id=5))  # type: ignore[arg-type]
    key_id = share.key_id  # type: ignore[attr-defined]
    path = store.directory / f"key-{key_id}.json"
    wrapper = json.loads(path.read_text())
    wrapper["content"]["threshold"] = 1  # an attempt to lower t
    edited = json.dumps(wrapper)
    path.write_text(edited)
    with pytest.raises(SecureAggregationError, match="integrity"):
        store.load_key(key_id)
    assert path.read_text() == edited  # refused, not repaired or deleted
    store.save_key(StoredKey(share, run_id=5))  # type: ignore[arg-type]
    os.chmod(path, 0o644)
    with pytest.raises(SecureAggregationError, match="readable by others"):
        store.load_key(key_id)
    with pytest.raises(NotFoundError):
        store.load_key("0" * 32)
    with pytest.raises(SecureAggregationError, match="32 hex"):
        store.load_key("../../etc/passwd")


def test_an_edited_swapped_missing_or_old_format_shares_file_is_refused(tmp_path: Path, share: object) -> None:
    store = KeyStore(tmp_path / "keys")
    store.save_key(StoredKey(share, run_id=5))  # type: ignore[arg-type]
    key_id = share.key_id  # type: ignore[attr-defined]
    shares_path = store.directory / f"key-{key_id}.shares"
    raw = bytearray(shares_path.read_bytes())
    raw[100] ^= 1  # one bit of one dealt share
    shares_path.write_bytes(bytes(raw))
    with pytest.raises(SecureAggregationError, match="shares.* integrity"):
        store.load_key(key_id)
    other = run_ceremony(MEMBERS, 2).shares[11]  # another key's shares under this key's name
    store.save_key(StoredKey(other, run_id=5))  # type: ignore[arg-type]
    shares_path.write_bytes((store.directory / f"key-{other.key_id}.shares").read_bytes())
    with pytest.raises(SecureAggregationError, match="integrity"):
        store.load_key(key_id)
    shares_path.unlink()
    with pytest.raises(SecureAggregationError, match="missing"):
        store.load_key(key_id)
    store.save_key(StoredKey(share, run_id=5))  # type: ignore[arg-type]
    path = store.directory / f"key-{key_id}.json"
    wrapper = json.loads(path.read_text())
    del wrapper["content"]["shares_file"]  # a key from before per-round c1: resealed as the old code wrote it
    store._write(path, wrapper["content"])
    with pytest.raises(SecureAggregationError, match="new key ceremony"):
        store.load_key(key_id)


def test_a_ceremony_in_progress_survives_a_reload_and_is_dropped_after(tmp_path: Path) -> None:
    ann = Announcement.new(MEMBERS, 2, CkksParams())
    party, _ = KeyParty.commit(ann, 12)
    store = KeyStore(tmp_path / "keys")
    store.save_party(party)
    loaded = store.load_party(ann.ceremony)
    assert np.array_equal(loaded.secret, party.secret) and loaded.transport_private == party.transport_private
    assert loaded.announcement == ann
    store.drop_party(ann.ceremony)
    with pytest.raises(NotFoundError):
        store.load_party(ann.ceremony)
