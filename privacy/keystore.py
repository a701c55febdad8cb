"""A node's threshold-CKKS key material on disk: one file per key, 0600, integrity-checked, written atomically.

What a key's JSON file holds: the joint public key, the ceremony's members and
holders, t, the CKKS parameters, which Flower run it was made for, and two ledgers, each written
*before* what it guards leaves the node (a crash can only make the node refuse more, never answer
twice): the (round, group) pairs this node has partially decrypted, and the round nonces it has
encrypted an update under (two encryptions under one nonce share their c1 and would give away the
difference of two updates). Its own secret s_i and its shares of every holder's secret (13 MB
for 100 holders at two primes) sit in a binary ``.shares`` file beside it, written once, whose
SHA-256 the JSON file records: the ledgers are rewritten every round without rewriting them.
A ceremony in progress (this node's fresh secret s_i between stages) has its own file and is
deleted when the ceremony ends. A SHA-256 over the content detects a corrupted or truncated file;
such a file is refused, never repaired. The hash is not keyed: it does not stop someone who can
write the node's key directory, who could also read the share itself — that directory's 0700/0600
modes and the node's host security are the boundary (docs/explanation/security.md). Nothing here logs; errors name the file, never its content.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from quorumfl.aggregation.ckks import Announcement, CkksParams, Commitment, KeyParty, KeyShare
from quorumfl.core.files import atomic_write
from quorumfl.errors import NotFoundError, SecureAggregationError

__all__ = ["KeyStore", "StoredKey"]

_KEY_ID = re.compile(r"^[0-9a-f]{32}$")
FORMAT = 1


@dataclass
class StoredKey:
    """A key share plus what the node remembers about its use."""

    share: KeyShare
    run_id: int
    asked: set[tuple[int, int]] = field(default_factory=set)
    encrypted: set[bytes] = field(default_factory=set)  # round nonces this node encrypted under


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise TypeError("expected base64 text")
    return base64.b64decode(text.encode("ascii"), validate=True)


def _array(values: np.ndarray) -> dict[str, Any]:
    return {"shape": list(values.shape), "data": _b64(np.ascontiguousarray(values, dtype="<u8").tobytes())}


def _unarray(data: Any) -> np.ndarray:
    shape = tuple(int(s) for s in data["shape"])
    return np.frombuffer(_unb64(data["data"]), dtype="<u8").astype(np.uint64).reshape(shape)


def _seal(content: dict[str, Any]) -> bytes:
    body = json.dumps(content, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(body.encode()).hexdigest()
    return json.dumps({"format": FORMAT, "sha256": digest, "content": content}, sort_keys=True).encode()


class KeyStore:
    """Key files of one node under ``directory`` (created 0700)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)

    # ---- files ------------------------------------------------------------------------------
    def _write(self, path: Path, content: dict[str, Any]) -> None:
        atomic_write(path, _seal(content), mode=0o600)

    def _read(self, path: Path, what: str) -> dict[str, Any]:
        if not path.exists():
            raise NotFoundError(f"no {what} at {path}")
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise SecureAggregationError(f"{what} file {path} is readable by others (mode {mode:o}); chmod 600 it")
        try:
            wrapper = json.loads(path.read_bytes())
            content = wrapper["content"]
            body = json.dumps(content, sort_keys=True, separators=(",", ":"))
            ok = wrapper.get("format") == FORMAT and hashlib.sha256(body.encode()).hexdigest() == wrapper["sha256"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SecureAggregationError(f"{what} file {path} is unreadable; restore it or run a new key ceremony") from exc
        if not ok:
            raise SecureAggregationError(f"{what} file {path} fails its integrity check; restore it or run a new key ceremony")
        if not isinstance(content, dict):
            raise SecureAggregationError(f"{what} file {path} is malformed")
        return content

    def _key_path(self, key_id: str) -> Path:
        if not _KEY_ID.match(key_id):
            raise SecureAggregationError(f"key id {key_id!r} is not 32 hex digits")
        return self.directory / f"key-{key_id}.json"

    def _shares_path(self, key_id: str) -> Path:
        return self._key_path(key_id).with_suffix(".shares")

    def _party_path(self, ceremony: bytes) -> Path:
        return self.directory / f"ceremony-{ceremony.hex()}.json"

    # ---- key shares -------------------------------------------------------------------------------
    def save_key(self, stored: StoredKey) -> None:
        """Write the shares file, then the JSON file that names its digest (a crash between the two
        leaves a key that fails its check: refused, never half-used)."""
        s = stored.share
        raw = np.ascontiguousarray(s.secret, dtype="<u8").tobytes() + np.ascontiguousarray(s.dealt, dtype="<u8").tobytes()
        atomic_write(self._shares_path(s.key_id), raw, mode=0o600)
        self._write(self._key_path(s.key_id), {
            "key_id": s.key_id, "ceremony": s.ceremony.hex(), "node": str(s.node), "index": s.index,
            "members": [str(m) for m in s.members], "holders": [str(h) for h in s.holders], "threshold": s.threshold,
            "params": s.params.to_dict(), "public_key": _b64(s.public_key),
            "shares_file": {"secret": list(s.secret.shape), "dealt": list(s.dealt.shape),
                            "sha256": hashlib.sha256(raw).hexdigest()},
            "run_id": stored.run_id, "asked": sorted([r, g] for r, g in stored.asked),
            "encrypted": sorted(n.hex() for n in stored.encrypted),
        })

    def _shares(self, key_id: str, spec: Any) -> tuple[np.ndarray, np.ndarray]:
        path = self._shares_path(key_id)
        if not path.exists():
            raise SecureAggregationError(f"key share file {path} is missing; restore it or run a new key ceremony")
        if path.stat().st_mode & 0o077:
            raise SecureAggregationError(f"key share file {path} is readable by others; chmod 600 it")
        raw = path.read_bytes()
        if not isinstance(spec, dict) or hashlib.sha256(raw).hexdigest() != spec.get("sha256"):
            raise SecureAggregationError(f"key share file {path} fails its integrity check; restore it or run a new "
                                         "key ceremony")
        secret_shape = tuple(int(d) for d in spec["secret"])
        dealt_shape = tuple(int(d) for d in spec["dealt"])
        cut = 8 * int(np.prod(secret_shape))
        if len(raw) != cut + 8 * int(np.prod(dealt_shape)):
            raise SecureAggregationError(f"key share file {path} has the wrong size")
        words = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
        return words[: cut // 8].reshape(secret_shape), words[cut // 8:].reshape(dealt_shape)

    def load_key(self, key_id: str) -> StoredKey:
        path = self._key_path(key_id)
        c = self._read(path, "key share")
        if "shares_file" not in c:
            raise SecureAggregationError(f"key {key_id} ({path}) was made by an older QuorumFL that encrypted under the "
                                         "public key; run a new key ceremony (quorumfl keys ceremony RUN)")
        try:
            secret, dealt = self._shares(key_id, c["shares_file"])
            share = KeyShare(
                key_id=str(c["key_id"]), ceremony=bytes.fromhex(c["ceremony"]), node=int(c["node"]), index=int(c["index"]),
                members=tuple(int(m) for m in c["members"]), holders=tuple(int(h) for h in c["holders"]),
                threshold=int(c["threshold"]), params=CkksParams.from_dict(c["params"]),
                public_key=_unb64(c["public_key"]), secret=secret, dealt=dealt,
            )
            stored = StoredKey(share, int(c["run_id"]), {(int(r), int(g)) for r, g in c["asked"]},
                               {bytes.fromhex(n) for n in c["encrypted"]})
        except (KeyError, TypeError, ValueError) as exc:
            raise SecureAggregationError(f"key share file {path} is malformed") from exc
        if share.key_id != key_id:
            raise SecureAggregationError(f"key share file {path} holds key {share.key_id}")
        if dealt.shape[0] != len(share.holders) or secret.shape[0] != dealt.shape[1]:
            raise SecureAggregationError(f"key share file {path} does not match its holders")
        return stored

    def _update_ledger(self, key_id: str, change: Callable[[dict[str, Any]], None]) -> None:
        path = self._key_path(key_id)
        content = self._read(path, "key share")
        try:
            change(content)
        except (KeyError, TypeError, ValueError) as exc:
            raise SecureAggregationError(f"key share file {path} is malformed") from exc
        self._write(path, content)

    def record_asked(self, key_id: str, round_number: int, group: int) -> None:
        """Add (round, group) to the decryption ledger on disk; call before answering."""
        def add(content: dict[str, Any]) -> None:
            pairs = {(int(r), int(g)) for r, g in content["asked"]} | {(round_number, group)}
            content["asked"] = sorted([r, g] for r, g in pairs)
        self._update_ledger(key_id, add)

    def record_encrypted(self, key_id: str, nonce: bytes) -> None:
        """Add a round nonce to the encryption ledger on disk, refusing one already there; call before
        the ciphertext leaves the node."""
        def add(content: dict[str, Any]) -> None:
            used = set(content["encrypted"])
            if nonce.hex() in used:
                raise SecureAggregationError(f"this node already encrypted an update under key {key_id} with round "
                                             f"nonce {nonce.hex()}; refusing a second (it would reveal the difference)")
            content["encrypted"] = sorted(used | {nonce.hex()})
        self._update_ledger(key_id, add)

    def keys(self) -> list[str]:
        return sorted(p.name[4:-5] for p in self.directory.glob("key-*.json"))

    # ---- a ceremony in progress ----------------------------------------------------------------------
    def save_party(self, party: KeyParty) -> None:
        ann = party.announcement
        self._write(self._party_path(ann.ceremony), {
            "ceremony": ann.ceremony.hex(), "members": [str(m) for m in ann.members], "threshold": ann.threshold,
            "params": ann.params.to_dict(), "seed": ann.seed.hex(), "node": str(party.node),
            "secret": _array(party.secret), "b": _array(party.b), "transport": party.transport_private.hex(),
            "commitments": {str(n): [c.digest.hex(), c.transport_key.hex(), c.department, c.signature.hex()]
                            for n, c in party.commitments.items()},
            "own_share": None if party.own_share is None else _array(party.own_share),
        })

    def load_party(self, ceremony: bytes) -> KeyParty:
        path = self._party_path(ceremony)
        c = self._read(path, "key ceremony state")
        try:
            ann = Announcement(bytes.fromhex(c["ceremony"]), tuple(int(m) for m in c["members"]), int(c["threshold"]),
                               CkksParams.from_dict(c["params"]), bytes.fromhex(c["seed"]))
            return KeyParty(
                announcement=ann, node=int(c["node"]), secret=_unarray(c["secret"]), b=_unarray(c["b"]),
                transport_private=bytes.fromhex(c["transport"]),
                commitments={int(n): Commitment(int(n), bytes.fromhex(d), bytes.fromhex(k), str(dep), bytes.fromhex(sig))
                             for n, (d, k, dep, sig) in c["commitments"].items()},
                own_share=None if c["own_share"] is None else _unarray(c["own_share"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SecureAggregationError(f"key ceremony state {path} is malformed") from exc

    def drop_party(self, ceremony: bytes) -> None:
        path = self._party_path(ceremony)
        if path.exists():
            path.unlink()
