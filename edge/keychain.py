"""Rotation of the edge signing key: each new key is endorsed by the key before it, and a device
follows that chain from the key it was given to the newest one, never anywhere else.

An endorsement is a signed statement, canonical JSON (sorted keys, compact)::

    {"schema": 1, "purpose": "quorumfl-edge-signing-key", "sequence": n,
     "previous": <hex of key n-1>, "public_key": <hex of key n>, "created_at": "..."}

signed with Ed25519 by key n − 1 (``quorumfl edge keys rotate``). Key 0 is the one made by
``edge keys init``. The sync server sends the whole chain with every manifest; a device holding key
k accepts the endorsements after k one by one, each only if it names the key the device trusts at
that step as ``previous``, carries the next sequence number and verifies with that key, and then
verifies the manifest with the newest key only. So:

- a key not endorsed by the one the device trusts is refused (a forged chain), and a chain that
  forks (two endorsements of one key) or skips a number is refused as a whole;
- once a device has moved to key k + 1, a manifest signed by key k is refused: a retired key that
  leaks later cannot sign artifacts for devices that have moved on;
- what rotation cannot do is revoke a key that was stolen *before* devices moved past it: the thief
  can endorse a key of their own. Revocation is re-provisioning: give devices a new ``--public-key``
  and a fresh ``--dir`` (docs/how-to/edge-devices.md).

The ``purpose`` field and the strict field set keep an endorsement from ever parsing as a manifest
and the other way round. Written here rather than taken from a library: X.509 cross-signing (the
other standard way to chain keys) would bring certificate parsing, validity periods and name rules
to devices that need one Ed25519 check per step. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from quorumfl.errors import ArtifactError

__all__ = ["PURPOSE", "Endorsement", "endorse", "follow", "from_json", "raw_public_key", "to_json", "trusted_keys"]

PURPOSE = "quorumfl-edge-signing-key"
_FIELDS = {"schema", "purpose", "sequence", "previous", "public_key", "created_at"}


def raw_public_key(key: Ed25519PublicKey) -> bytes:
    """The key's 32 raw bytes: what endorsements name and compare."""
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _hex32(body: dict[str, Any], name: str) -> bytes:
    value = body[name]
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != 32 or value != raw.hex():
        raise ArtifactError(f"signing-key endorsement has an invalid {name}; the key chain is refused")
    return raw


@dataclass(frozen=True)
class Endorsement:
    """Key ``sequence`` (``public_key``) endorsed by key ``sequence − 1`` (``previous``)."""

    statement: bytes  # the canonical JSON the signature covers
    signature: bytes
    sequence: int
    previous: bytes
    public_key: bytes

    @classmethod
    def parse(cls, statement: bytes, signature: bytes) -> Endorsement:
        """Read a statement, refusing anything but exactly the expected fields and types (the
        signature is checked by ``follow``, against the key the device trusts)."""
        try:
            body = json.loads(statement.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ArtifactError("signing-key endorsement is not JSON; the key chain is refused") from None
        if not isinstance(body, dict) or set(body) != _FIELDS or body["schema"] != 1 or body["purpose"] != PURPOSE:
            raise ArtifactError("signing-key endorsement has unexpected fields or purpose; the key chain is refused")
        if type(body["sequence"]) is not int or body["sequence"] < 1 or not isinstance(body["created_at"], str):
            raise ArtifactError("signing-key endorsement has an invalid sequence or date; the key chain is refused")
        if _canonical(body) != statement:
            raise ArtifactError("signing-key endorsement is not in canonical form; the key chain is refused")
        if len(signature) != 64:
            raise ArtifactError("signing-key endorsement signature is not 64 bytes; the key chain is refused")
        return cls(statement, signature, body["sequence"], _hex32(body, "previous"), _hex32(body, "public_key"))


def to_json(chain: Sequence[Endorsement]) -> list[dict[str, str]]:
    """The endorsements as JSON values (the server's chain file, a device's ``trust.json``)."""
    return [{"statement": e.statement.decode(), "signature": e.signature.hex()} for e in chain]


def from_json(items: Any) -> list[Endorsement]:
    """Read what ``to_json`` wrote; raises ``ArtifactError`` (malformed) or ``KeyError``/``TypeError``/
    ``AttributeError``/``ValueError`` (not that shape), for the caller to name the file."""
    return [Endorsement.parse(item["statement"].encode(), bytes.fromhex(item["signature"])) for item in items]


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def endorse(old: Ed25519PrivateKey, new: Ed25519PublicKey, *, sequence: int, created_at: str) -> Endorsement:
    """Key ``old`` (number ``sequence − 1``) endorses ``new`` as key number ``sequence``."""
    if sequence < 1:
        raise ValueError("the first endorsed key is number 1 (key 0 is the one devices were given)")
    body = {"schema": 1, "purpose": PURPOSE, "sequence": sequence, "previous": raw_public_key(old.public_key()).hex(),
            "public_key": raw_public_key(new).hex(), "created_at": created_at}
    statement = _canonical(body)
    return Endorsement.parse(statement, old.sign(statement))


def _check_shape(chain: Sequence[Endorsement]) -> None:
    """Numbers 1..n in order, each naming the key the one before it endorsed."""
    for index, item in enumerate(chain):
        if item.sequence != index + 1:
            raise ArtifactError(f"the signing-key chain skips or repeats a number (found {item.sequence} where "
                                f"{index + 1} belongs); it is refused")
        if index and item.previous != chain[index - 1].public_key:
            raise ArtifactError(f"signing-key endorsement {item.sequence} does not continue from key "
                                f"{item.sequence - 1} (a forked chain); it is refused")


def _walk(trusted: bytes, items: Sequence[Endorsement]) -> None:
    """Each of ``items`` is signed by the key before it, starting at ``trusted``, and numbered on."""
    current = trusted
    for index, item in enumerate(items):
        if item.previous != current or (index and item.sequence != items[index - 1].sequence + 1):
            raise ArtifactError(f"signing-key endorsement {item.sequence} does not continue from the key this device "
                                "trusts; the key chain is refused")
        try:
            Ed25519PublicKey.from_public_bytes(current).verify(item.signature, item.statement)
        except (InvalidSignature, ValueError):
            raise ArtifactError(f"signing-key endorsement {item.sequence} is not signed by key {item.sequence - 1}, "
                                "the key this device trusts; the key chain is refused") from None
        current = item.public_key


def follow(trusted: bytes, chain: Sequence[Endorsement]) -> list[Endorsement]:
    """The endorsements of ``chain`` after the key ``trusted`` (raw bytes), each verified with the
    key before it; ``[]`` when ``trusted`` is the newest. Raises ``ArtifactError`` when the chain is
    malformed, does not contain ``trusted``, or any later step does not verify."""
    _check_shape(chain)
    if not chain or chain[-1].public_key == trusted:
        return []
    starts = [i for i, item in enumerate(chain) if item.previous == trusted]
    if not starts:
        raise ArtifactError("the server's signing-key chain does not contain the key this device trusts (a key "
                            "chain of another federation, or a forged one); nothing is accepted")
    accepted = list(chain[starts[0]:])
    _walk(trusted, accepted)
    return accepted


def trusted_keys(root: bytes, accepted: Sequence[Endorsement]) -> list[bytes]:
    """Every key a device has trusted, oldest first: its provisioned key, then each it accepted
    (re-verified here, so a damaged or edited record is refused rather than believed)."""
    _walk(root, accepted)
    return [root, *(item.public_key for item in accepted)]
