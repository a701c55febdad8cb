"""Who a secure-aggregation peer is: the admin's roster of departments and their signed messages.

Against an active server, a node must not take the server's word for a neighbour's public keys:
the server could hand out keys of its own and unmask one department's update in a single round. So
every key advertisement is signed with the department's registered node key (ECDSA P-384, the key
its SuperNode authenticates with), and a node accepts a peer only when the signature verifies under
the key that the admin's roster lists for that department. The roster reaches the node inside the
admin-signed run config (``quorumfl.deploy.app_guard`` checks that signature before the app runs),
so the server can neither forge an entry nor add one. A department's name is the roster entry whose
key verifies, never what a node or the server says.

What is signed binds the purpose, the run, the key epoch, the epoch's parameters and cohort as the
node was told them (``messages.announcement_terms``), the node's Flower id, the department and
every public key of the advertisement, so a signed advertisement cannot be replayed into another
epoch or run, or claimed by another node, and a peer told other parameters refuses it. The consistency stage's signatures bind the run, epoch,
slot and the survivor/dropped sets (Bonawitz et al. 2017, the active-server variant). Pure: keys and bytes in, a verdict out (fails closed with
``SecureAggregationError``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from quorumfl.errors import SecureAggregationError

__all__ = ["Roster", "advertisement_message", "department_message", "field_bytes", "load_signing_key", "parse_ec_private_key", "sign", "view_message"]

_AD_CONTEXT = b"quorumfl-secagg-advertisement-v1"
_VIEW_CONTEXT = b"quorumfl-secagg-survivors-v1"
_DEPARTMENT_CONTEXT = b"quorumfl-department-v1"
_HASH = hashes.SHA384()


def field_bytes(data: bytes) -> bytes:
    """One length-prefixed field of a signed message."""
    return len(data).to_bytes(4, "big") + data


def advertisement_message(*, binding: bytes, epoch: bytes, terms: bytes, node: int, department: str,
                          share_key: bytes, mask_keys: tuple[bytes, ...]) -> bytes:
    """The bytes a node signs for its key advertisement (length-prefixed fields: unambiguous);
    ``terms`` is the digest of the epoch's parameters and cohort as this node was told them."""
    parts = [_AD_CONTEXT, binding, epoch, terms, node.to_bytes(8, "big"), department.encode(), share_key, *mask_keys]
    return b"".join(field_bytes(p) for p in parts)


def department_message(*, binding: bytes, node: int, department: str) -> bytes:
    """The bytes a node signs to say which roster department it is, in every reply of a run."""
    return b"".join(field_bytes(p) for p in (_DEPARTMENT_CONTEXT, binding, node.to_bytes(8, "big"), department.encode()))


def view_message(*, binding: bytes, epoch: bytes, slot: int,
                 view: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]) -> bytes:
    """The bytes a survivor signs in the consistency stage: who survived and who dropped, per group."""
    parts = [_VIEW_CONTEXT, binding, epoch, slot.to_bytes(4, "big")]
    for alive, gone in view:
        parts += [b"".join(n.to_bytes(8, "big") for n in alive), b"".join(n.to_bytes(8, "big") for n in gone)]
    return b"".join(field_bytes(p) for p in parts)


def parse_ec_private_key(data: bytes) -> ec.EllipticCurvePrivateKey:
    """An unencrypted ECDSA private key in OpenSSH or PEM form (as 'quorumfl certs' writes them);
    raises ``ValueError`` saying what is wrong."""
    try:
        key = (serialization.load_ssh_private_key(data, None) if data.startswith(b"-----BEGIN OPENSSH")
               else serialization.load_pem_private_key(data, None))
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"not an unencrypted PEM/OpenSSH private key ({exc})") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("not an ECDSA key")
    return key


def load_signing_key(data: bytes, *, source: str) -> ec.EllipticCurvePrivateKey:
    """A node's private key (OpenSSH or PEM, as 'quorumfl certs add-node' writes it)."""
    try:
        return parse_ec_private_key(data)
    except ValueError as exc:
        raise SecureAggregationError(f"node key {source} is {exc}") from exc


def sign(key: ec.EllipticCurvePrivateKey, message: bytes) -> bytes:
    return key.sign(message, ec.ECDSA(_HASH))


@dataclass(frozen=True)
class Roster:
    """The admin's list of departments and their node public keys (OpenSSH lines)."""

    keys: Mapping[str, ec.EllipticCurvePublicKey]

    @classmethod
    def from_json(cls, text: str) -> Roster:
        try:
            raw = json.loads(text)
            if not isinstance(raw, dict) or not raw:
                raise ValueError("expected a non-empty object of department: public key")
            keys: dict[str, ec.EllipticCurvePublicKey] = {}
            for name, line in raw.items():
                key = serialization.load_ssh_public_key(str(line).encode())
                if not isinstance(key, ec.EllipticCurvePublicKey):
                    raise ValueError(f"{name}'s key is not ECDSA")
                keys[str(name)] = key
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise SecureAggregationError(f"the run's roster is unusable ({exc})") from exc
        fingerprints = [cls._fingerprint(k) for k in keys.values()]
        if len(set(fingerprints)) != len(fingerprints):
            raise SecureAggregationError("the run's roster lists one key for two departments")
        return cls(keys)

    @staticmethod
    def _fingerprint(key: ec.EllipticCurvePublicKey) -> str:
        return hashlib.sha256(key.public_bytes(serialization.Encoding.DER,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)).hexdigest()

    def check(self, department: str, message: bytes, signature: bytes, *, node: int) -> None:
        """Raise unless ``signature`` over ``message`` verifies under ``department``'s roster key."""
        key = self.keys.get(department)
        if key is None:
            raise SecureAggregationError(f"department {department!r} is not on the admin's roster", node=str(node))
        try:
            key.verify(signature, message, ec.ECDSA(_HASH))
        except InvalidSignature:
            raise SecureAggregationError(
                f"message claimed for department {department!r} is not signed by its registered key; "
                "refusing it (substituted, forged or replayed)", node=str(node)) from None

    def department_of(self, key: ec.EllipticCurvePrivateKey) -> str:
        """The roster name of the department whose public key matches ``key`` (this node's own)."""
        mine = self._fingerprint(key.public_key())
        for name, public in self.keys.items():
            if self._fingerprint(public) == mine:
                return name
        raise SecureAggregationError("this node's key is not on the admin's roster; the admin registers it "
                                     "('quorumfl certs add-node') before the run")
