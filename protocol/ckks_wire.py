"""Threshold-CKKS messages as Flower records (both ends use this codec).

Message types: ``query.ckks_commit``, ``query.ckks_reveal``, ``query.ckks_finish`` (the key
ceremony, one round trip each), ``train`` carrying a ``ckks`` ConfigRecord (the reply carries the
encrypted payload in the ``encrypted`` ArrayRecord instead of ``arrays``), and
``query.ckks_decrypt`` (the manifest and the contributors' signed records, no arrays: every
decryptor derives the round's c1 itself; the reply carries the partial decryption).
Node ids travel as 8-byte big-endian strings. Every decoder checks types and shapes and raises
``SecureAggregationError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord
from numpy.typing import NDArray

from quorumfl.aggregation.ckks import (
    Announcement,
    CkksParams,
    Commitment,
    Contribution,
    Manifest,
    Reveal,
    pack_residues,
    unpack_residues,
)
from quorumfl.aggregation.ckks.threshold import NONCE_BYTES
from quorumfl.errors import ConfigError, SecureAggregationError
from quorumfl.protocol.secure_wire import _get, _ids, _read_ids

__all__ = [
    "CKKS",
    "COMMIT",
    "DECRYPT",
    "ENCRYPTED",
    "FINISH",
    "REVEAL",
    "TrainRequest",
    "decode_announcement",
    "decode_commitment",
    "decode_decrypt_request",
    "decode_directory",
    "decode_encrypted",
    "decode_finish",
    "decode_partial",
    "decode_reveal",
    "decode_train_request",
    "encode_announcement",
    "encode_commitment",
    "encode_decrypt_request",
    "encode_directory",
    "encode_encrypted",
    "encode_finish",
    "finish_arrays",
    "encode_partial",
    "encode_reveal",
    "encode_train_request",
]

CKKS = "ckks"
ARRAYS = "ckks-arrays"
ENCRYPTED = "encrypted"
COMMIT = "query.ckks_commit"
REVEAL = "query.ckks_reveal"
FINISH = "query.ckks_finish"
DECRYPT = "query.ckks_decrypt"
U64 = NDArray[np.uint64]


def _array(record: ArrayRecord, key: str, dtype: type[np.generic], ndim: int) -> NDArray[np.generic]:
    if key not in record:
        raise SecureAggregationError(f"threshold-CKKS record has no array '{key}'")
    try:
        values: NDArray[np.generic] = record[key].numpy()
    except Exception as exc:  # a malformed array from a remote party
        raise SecureAggregationError(f"array '{key}' cannot be decoded ({exc})") from exc
    if values.dtype != dtype or values.ndim != ndim:
        raise SecureAggregationError(f"array '{key}' must be {ndim}-D {np.dtype(dtype)}, got {values.ndim}-D {values.dtype}")
    return np.ascontiguousarray(values)


def _u64(record: ArrayRecord, key: str, ndim: int) -> U64:
    return _array(record, key, np.uint64, ndim)  # type: ignore[return-value]


def _packed(residues: U64) -> Array:
    """The large residue arrays (ciphertexts, partial decryptions) travel at 60 bits per residue."""
    return Array(pack_residues(residues))


def _unpacked(record: ArrayRecord, key: str, ndim: int) -> U64:
    return unpack_residues(_array(record, key, np.uint8, ndim))  # type: ignore[arg-type]


def _strings(record: ConfigRecord, key: str) -> list[str]:
    if key not in record:
        raise SecureAggregationError(f"threshold-CKKS record is missing '{key}'")
    value = record[key]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SecureAggregationError(f"threshold-CKKS '{key}' must be a list of strings")
    return [str(v) for v in value]


# ---- ceremony ---------------------------------------------------------------------------------------
def encode_announcement(a: Announcement, *, run_id: int) -> ConfigRecord:
    return ConfigRecord({"ceremony": a.ceremony, "members": _ids(a.members), "threshold": a.threshold,
                         "params": json.dumps(a.params.to_dict()), "seed": a.seed, "run": run_id})


def _json(record: ConfigRecord, key: str) -> Any:
    """A JSON field another party wrote; ``SecureAggregationError`` for anything ``json`` cannot read
    (nesting deep enough to exhaust the parser included)."""
    try:
        return json.loads(_get(record, key, str))
    except (ValueError, RecursionError) as exc:
        raise SecureAggregationError(f"threshold-CKKS '{key}' is not readable JSON ({type(exc).__name__})") from None


def decode_announcement(record: ConfigRecord) -> tuple[Announcement, int]:
    try:
        params = CkksParams.from_dict(_json(record, "params"))
        ann = Announcement(_get(record, "ceremony", bytes), _read_ids(record, "members"), _get(record, "threshold", int),
                           params, _get(record, "seed", bytes))
    except (ConfigError, ValueError) as exc:
        raise SecureAggregationError(f"key ceremony announcement is invalid: {exc}") from exc
    return ann, _get(record, "run", int)


def encode_commitment(c: Commitment, ceremony: bytes) -> ConfigRecord:
    return ConfigRecord({"ceremony": ceremony, "digest": c.digest, "transport": c.transport_key,
                         "department": c.department, "signature": c.signature})


def decode_commitment(record: ConfigRecord, *, node: int, ceremony: bytes) -> Commitment:
    if _get(record, "ceremony", bytes) != ceremony:
        raise SecureAggregationError("commitment is for another ceremony")
    return Commitment(node, _get(record, "digest", bytes), _get(record, "transport", bytes),
                      _get(record, "department", str), _get(record, "signature", bytes))


def encode_directory(ceremony: bytes, commitments: Mapping[int, Commitment]) -> ConfigRecord:
    nodes = sorted(commitments)
    return ConfigRecord({"ceremony": ceremony, "nodes": _ids(nodes),
                         "digests": [commitments[n].digest for n in nodes],
                         "transports": [commitments[n].transport_key for n in nodes],
                         "departments": [commitments[n].department for n in nodes],
                         "signatures": [commitments[n].signature for n in nodes]})


def decode_directory(record: ConfigRecord) -> tuple[bytes, dict[int, Commitment]]:
    nodes = _read_ids(record, "nodes")
    digests, transports = _get(record, "digests", list), _get(record, "transports", list)
    departments, signatures = _strings(record, "departments"), _get(record, "signatures", list)
    if not len(nodes) == len(digests) == len(transports) == len(departments) == len(signatures):
        raise SecureAggregationError("commitment directory lists differ in length")
    return _get(record, "ceremony", bytes), {
        n: Commitment(n, d, k, dep, sig)
        for n, d, k, dep, sig in zip(nodes, digests, transports, departments, signatures, strict=True)
    }


def encode_reveal(r: Reveal, ceremony: bytes) -> tuple[ConfigRecord, ArrayRecord]:
    recipients = sorted(r.bundles)
    config = ConfigRecord({"ceremony": ceremony, "recipients": _ids(recipients),
                           "bundles": [r.bundles[n] for n in recipients]})
    return config, ArrayRecord({"b": Array(np.ascontiguousarray(r.b))})


def decode_reveal(record: ConfigRecord, arrays: ArrayRecord, *, node: int, ceremony: bytes) -> Reveal:
    if _get(record, "ceremony", bytes) != ceremony:
        raise SecureAggregationError("reveal is for another ceremony")
    recipients = _read_ids(record, "recipients")
    bundles = _get(record, "bundles", list)
    if len(recipients) != len(bundles):
        raise SecureAggregationError("reveal lists differ in length")
    return Reveal(node, _u64(arrays, "b", 2), dict(zip(recipients, bundles, strict=True)))


def finish_arrays(reveals: Mapping[int, U64]) -> ArrayRecord:
    """The revealed public-key parts every finish request carries: the same for every member, so the
    server builds it once and hands the same record to every message (at 100 members it is 100
    polynomials, 13 MB, which 100 copies made 1.3 GB of the server's memory)."""
    return ArrayRecord({f"b-{n}": Array(np.ascontiguousarray(reveals[n])) for n in sorted(reveals)})


def encode_finish(ceremony: bytes, reveals: Mapping[int, U64], inbox: Mapping[int, bytes],
                  arrays: ArrayRecord | None = None) -> tuple[ConfigRecord, ArrayRecord]:
    """One member's finish request: its inbox of bundles, and ``arrays`` (``finish_arrays(reveals)``,
    built here when not given)."""
    senders = sorted(inbox)
    config = ConfigRecord({"ceremony": ceremony, "revealers": _ids(sorted(reveals)), "senders": _ids(senders),
                           "bundles": [inbox[n] for n in senders]})
    return config, arrays if arrays is not None else finish_arrays(reveals)


def decode_finish(record: ConfigRecord, arrays: ArrayRecord) -> tuple[bytes, dict[int, U64], dict[int, bytes]]:
    revealers = _read_ids(record, "revealers")
    senders = _read_ids(record, "senders")
    bundles = _get(record, "bundles", list)
    if len(senders) != len(bundles):
        raise SecureAggregationError("finish request lists differ in length")
    reveals = {n: _u64(arrays, f"b-{n}", 2) for n in revealers}
    return _get(record, "ceremony", bytes), reveals, dict(zip(senders, bundles, strict=True))


# ---- rounds -------------------------------------------------------------------------------------------
class TrainRequest:
    """What a node needs to encrypt its update: the key (public key included), level, clip, weight cap,
    who the round's participants are, and the round's nonce (with key, round and group it names
    the common c1)."""

    def __init__(self, *, key_id: str, public_key: bytes, params: CkksParams, primes: int, clip: float,
                 max_weight: float, round_number: int, participants: tuple[int, ...], nonce: bytes,
                 group: int = 0) -> None:
        self.key_id, self.public_key, self.params = key_id, public_key, params
        self.primes, self.clip, self.max_weight, self.round_number = primes, clip, max_weight, round_number
        self.participants, self.group, self.nonce = participants, group, nonce


def encode_train_request(r: TrainRequest) -> ConfigRecord:
    return ConfigRecord({"key_id": r.key_id, "public_key": r.public_key, "params": json.dumps(r.params.to_dict()),
                         "primes": r.primes, "clip": r.clip, "max_weight": r.max_weight, "round": r.round_number,
                         "group": r.group, "participants": _ids(r.participants), "nonce": r.nonce})


def decode_train_request(record: ConfigRecord) -> TrainRequest:
    try:
        params = CkksParams.from_dict(_json(record, "params"))
    except (ConfigError, ValueError) as exc:
        raise SecureAggregationError(f"CKKS parameters in the train request are invalid: {exc}") from exc
    group = _get(record, "group", int)
    if not -(2**31) <= group < 2**31:
        raise SecureAggregationError(f"threshold-CKKS 'group' must fit 32 bits, got {group}")
    round_number = _get(record, "round", int)
    if not 0 <= round_number < 2**63:
        raise SecureAggregationError(f"threshold-CKKS 'round' must be a round number, got {round_number}")
    primes = _get(record, "primes", int)
    if not 1 <= primes <= len(params.data_bits):
        raise SecureAggregationError(f"threshold-CKKS 'primes' must be between 1 and {len(params.data_bits)}, got {primes}")
    clip, max_weight = _get(record, "clip", float), _get(record, "max_weight", float)
    if not (clip > 0 and max_weight > 0):
        raise SecureAggregationError("clip and max_weight must be positive")
    nonce = _get(record, "nonce", bytes)
    if len(nonce) != NONCE_BYTES:
        raise SecureAggregationError(f"the round nonce must be {NONCE_BYTES} bytes")
    return TrainRequest(key_id=_get(record, "key_id", str), public_key=_get(record, "public_key", bytes), params=params,
                        primes=primes, clip=clip, max_weight=max_weight,
                        round_number=round_number, participants=_read_ids(record, "participants"),
                        nonce=nonce, group=group)


def encode_encrypted(c0: U64, contribution: Contribution, *, key_id: str,
                     round_number: int) -> tuple[ArrayRecord, ConfigRecord]:
    return ArrayRecord({"ct": _packed(c0)}), ConfigRecord({
        "key_id": key_id, "round": round_number, "department": contribution.department,
        "digest": contribution.digest, "signature": contribution.signature})


def decode_encrypted(arrays: ArrayRecord, record: ConfigRecord, *, node: int) -> tuple[U64, Contribution, str, int]:
    contribution = Contribution(node, _get(record, "department", str), _get(record, "digest", bytes),
                                _get(record, "signature", bytes))
    return _unpacked(arrays, "ct", 3), contribution, _get(record, "key_id", str), _get(record, "round", int)


def encode_decrypt_request(manifest: Manifest, contributions: Mapping[int, Contribution]) -> ConfigRecord:
    nodes = sorted(contributions)
    return ConfigRecord({
        "manifest": json.dumps(manifest.to_dict()), "tag-nodes": _ids(nodes),
        "tag-departments": [contributions[n].department for n in nodes],
        "tags": [contributions[n].digest for n in nodes], "tag-signatures": [contributions[n].signature for n in nodes],
    })


def decode_decrypt_request(record: ConfigRecord) -> tuple[Manifest, list[Contribution]]:
    data = _json(record, "manifest")
    if not isinstance(data, dict):
        raise SecureAggregationError("decryption manifest must be an object")
    nodes = _read_ids(record, "tag-nodes")
    departments, tags = _strings(record, "tag-departments"), _get(record, "tags", list)
    signatures = _get(record, "tag-signatures", list)
    if not len(nodes) == len(departments) == len(tags) == len(signatures):
        raise SecureAggregationError("decryption request's tag lists differ in length")
    contributions = [Contribution(n, d, t, g) for n, d, t, g in zip(nodes, departments, tags, signatures, strict=True)]
    return Manifest.from_dict(data), contributions


def encode_partial(d: U64, manifest: Manifest) -> tuple[ConfigRecord, ArrayRecord]:
    return (ConfigRecord({"key_id": manifest.key_id, "round": manifest.round, "group": manifest.group}),
            ArrayRecord({"d": _packed(d)}))


def decode_partial(record: ConfigRecord, arrays: ArrayRecord, manifest: Manifest) -> U64:
    if (_get(record, "key_id", str), _get(record, "round", int), _get(record, "group", int)) != (
        manifest.key_id, manifest.round, manifest.group
    ):
        raise SecureAggregationError("partial decryption answers another request")
    return _unpacked(arrays, "d", 3)
