"""Rotating the edge signing key (``quorumfl edge keys rotate``): a new key, endorsed by the old one
in the chain file beside the key, and every published manifest signed again with the new key.

Files, for the key ``HOME/edge/signing-key.pem``::

    signing-key.pem          the current private key (0600)
    signing-key.pub.pem      its public key: what newly provisioned devices are given
    signing-key.chain.json   {"endorsements": [{"statement": ..., "signature": hex}, ...]}, key 1..n,
                             each endorsed by the key before it (``quorumfl.edge.keychain``); public,
                             served to devices with every manifest
    signing-key.next.pem     only while a rotation is under way

A rotation writes the new key to ``.next.pem``, appends its endorsement to the chain (the point of no
return: from here on the new key is the one devices will move to), moves the new key into place,
writes its public key, and signs every artifact's manifest again with it in one transaction. The
old private key is gone once the new one is in place: nothing needs it any more, and a key that no
longer exists cannot leak. A rotation interrupted at any step is finished by the next
``edge keys rotate`` (which then stops, without rotating again): a ``.next.pem`` the chain does not
name yet is discarded, one it names is moved into place, and manifests that do not verify with the
current key are signed again. Until then devices refuse what the old key signed after they moved on,
so an interruption fails closed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from quorumfl.core.files import atomic_write
from quorumfl.edge.keychain import Endorsement, endorse, from_json, raw_public_key, to_json
from quorumfl.edge.signing import load_private_key, public_key_path, verifies
from quorumfl.errors import ArtifactError, ConfigError
from quorumfl.server.state.artifacts import ArtifactRecords

__all__ = ["Rotation", "chain_path", "load_chain", "rotate_signing_key"]


def chain_path(private_path: Path) -> Path:
    return private_path.with_name(private_path.stem + ".chain.json")


def _next_path(private_path: Path) -> Path:
    return private_path.with_name(private_path.stem + ".next.pem")


def load_chain(private_path: Path) -> list[Endorsement]:
    """The endorsements beside the key (``[]`` before the first rotation)."""
    path = chain_path(private_path)
    if not path.exists():
        return []
    try:
        body = json.loads(path.read_text())
        return from_json(body["endorsements"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"signing-key chain {path} is unreadable ({exc}); restore it from a backup") from exc
    except ArtifactError as exc:
        raise ConfigError(f"signing-key chain {path} is damaged ({exc}); restore it from a backup") from exc


def _write_chain(private_path: Path, chain: list[Endorsement]) -> None:
    body = {"endorsements": to_json(chain)}
    atomic_write(chain_path(private_path), json.dumps(body, indent=1).encode())


def _public_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@dataclass(frozen=True)
class Rotation:
    sequence: int  # the current key's number (0: never rotated)
    fingerprint: str  # hex of the current key's raw public bytes
    resigned: int  # artifact rows signed again
    finished_interrupted: bool  # this call finished an interrupted rotation instead of starting one


def _finish(private_path: Path, records: ArtifactRecords, chain: list[Endorsement]) -> Rotation | None:
    """Complete an interrupted rotation; None when there was none."""
    pending = _next_path(private_path)
    key = load_private_key(private_path)
    did = False
    if chain and chain[-1].public_key != raw_public_key(key.public_key()):
        if not pending.exists() or raw_public_key(load_private_key(pending).public_key()) != chain[-1].public_key:
            raise ConfigError(f"the signing-key chain {chain_path(private_path)} ends at a key that is neither "
                              f"{private_path} nor a pending rotation; restore the key and chain from one backup")
        os.replace(pending, private_path)
        key = load_private_key(private_path)
        did = True
    elif pending.exists():  # written before the chain named it: that rotation never happened
        pending.unlink()
    public_file = public_key_path(private_path)
    if not public_file.exists() or public_file.read_bytes() != _public_pem(key):
        atomic_write(public_file, _public_pem(key))
        did = True
    public = key.public_key()
    stale = [row for row in records.list() if not verifies(public, row.manifest.encode(), bytes.fromhex(row.signature))]
    resigned = records.resign(lambda manifest: key.sign(manifest).hex()) if stale else 0
    if not did and not resigned:
        return None
    return Rotation(len(chain), raw_public_key(public).hex(), resigned, True)


def rotate_signing_key(private_path: Path, records: ArtifactRecords, *, created_at: str) -> Rotation:
    """Rotate the key at ``private_path`` (see the module docstring), or finish an interrupted rotation."""
    load_private_key(private_path)  # a missing or unreadable key: its own clear error first
    chain = load_chain(private_path)
    finished = _finish(private_path, records, chain)
    if finished is not None:
        return finished
    old = load_private_key(private_path)
    new = Ed25519PrivateKey.generate()
    pending = _next_path(private_path)
    atomic_write(pending, new.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()), mode=0o600)
    chain.append(endorse(old, new.public_key(), sequence=len(chain) + 1, created_at=created_at))
    _write_chain(private_path, chain)
    os.replace(pending, private_path)
    atomic_write(public_key_path(private_path), _public_pem(new))
    resigned = records.resign(lambda manifest: new.sign(manifest).hex())
    return Rotation(len(chain), raw_public_key(new.public_key()).hex(), resigned, False)
