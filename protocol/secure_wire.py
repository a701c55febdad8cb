"""The masking protocol's messages as Flower records (both ends use this codec).

Message types: ``query.secagg_advertise`` and ``query.secagg_share`` (key epoch setup),
``train`` carrying a ``secagg`` ConfigRecord (the mask request; the reply carries the masked vector
in the ``masked`` ArrayRecord instead of ``arrays``), ``query.secagg_confirm`` (signed epochs: the
survivors sign the round's view) and ``query.secagg_unmask``.
Node ids are Flower's uint64 ids and travel as 8-byte big-endian strings (ConfigRecord integers are
signed 64-bit). Every decoder checks types and sizes and raises ``SecureAggregationError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord
from numpy.typing import NDArray

from quorumfl.aggregation.secagg import (
    EpochAnnouncement,
    KeyAdvertisement,
    KeyDirectory,
    MaskingParams,
    MaskRequest,
    ShareBundle,
    UnmaskReply,
    UnmaskRequest,
)
from quorumfl.aggregation.secagg.messages import pack_ids, unpack_ids
from quorumfl.aggregation.secagg.shamir import share_from_bytes, share_to_bytes
from quorumfl.errors import SecureAggregationError

__all__ = [
    "ADVERTISE",
    "CONFIRM",
    "MASKED",
    "MISSING_KEYS",
    "SECAGG",
    "SHARE",
    "UNMASK",
    "decode_advertisement",
    "decode_announcement",
    "decode_bundles",
    "decode_confirmation",
    "decode_directory",
    "decode_mask_request",
    "decode_masked",
    "decode_unmask_reply",
    "decode_unmask_request",
    "encode_advertisement",
    "encode_announcement",
    "encode_bundles",
    "encode_confirmation",
    "encode_directory",
    "encode_mask_request",
    "encode_masked",
    "encode_unmask_reply",
    "encode_unmask_request",
]

# A node that lost its epoch state says so with this phrase; the server then re-keys next round.
MISSING_KEYS = "holds no secure-aggregation keys"
SECAGG = "secagg"
MASKED = "masked"
ADVERTISE = "query.secagg_advertise"
SHARE = "query.secagg_share"
UNMASK = "query.secagg_unmask"
CONFIRM = "query.secagg_confirm"  # signed epochs: each survivor signs the round's survivor/dropped view


_ids = pack_ids


def _get(record: ConfigRecord, key: str, kind: type) -> Any:
    if key not in record:
        raise SecureAggregationError(f"secure-aggregation record is missing '{key}'")
    value = record[key]
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, bytes) for v in value):
            raise SecureAggregationError(f"secure-aggregation '{key}' must be a list of bytes")
        return value
    if not isinstance(value, kind) or isinstance(value, bool):
        raise SecureAggregationError(f"secure-aggregation '{key}' must be {kind.__name__}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise SecureAggregationError(f"secure-aggregation '{key}' must be a finite number, got {value!r}")
    if isinstance(value, int) and not -(2**63) <= value < 2**64:  # a record holds signed or unsigned 64-bit ints
        raise SecureAggregationError(f"secure-aggregation '{key}' must fit 64 bits, got {value!r}")
    return value


def _slot(record: ConfigRecord) -> int:
    """A request's slot: a key epoch has at most 10,000 (``MaskingParams.check``)."""
    slot = _get(record, "slot", int)
    if not 0 <= slot < 10_000:
        raise SecureAggregationError(f"secure-aggregation 'slot' must be in [0, 10000), got {slot}")
    return int(slot)


def _read_ids(record: ConfigRecord, key: str) -> tuple[int, ...]:
    try:
        return unpack_ids(_get(record, key, bytes))
    except ValueError:
        raise SecureAggregationError(f"secure-aggregation '{key}' is not a list of 8-byte node ids") from None


# ---- setup ------------------------------------------------------------------------------------
def encode_announcement(a: EpochAnnouncement) -> ConfigRecord:
    return ConfigRecord({"epoch": a.epoch, "cohort": _ids(a.cohort), **a.params.to_dict()})


def decode_announcement(record: ConfigRecord) -> EpochAnnouncement:
    params = MaskingParams.from_dict({k: record[k] for k in MaskingParams(2, 1).to_dict() if k in record})
    return EpochAnnouncement(epoch=_get(record, "epoch", bytes), cohort=_read_ids(record, "cohort"), params=params)


def encode_advertisement(ad: KeyAdvertisement) -> ConfigRecord:
    return ConfigRecord({"share-key": ad.share_key, "mask-keys": list(ad.mask_keys), "department": ad.department,
                         "signature": ad.signature})


def decode_advertisement(record: ConfigRecord, *, node: int) -> KeyAdvertisement:
    """The sender is the reply's source node, never an id the payload claims."""
    return KeyAdvertisement(node, _get(record, "share-key", bytes), tuple(_get(record, "mask-keys", list)),
                            _get(record, "department", str), _get(record, "signature", bytes))


def encode_directory(d: KeyDirectory) -> ConfigRecord:
    owners = sorted(d.keys)
    return ConfigRecord(
        {
            "epoch": d.epoch,
            "members": _ids(d.members),
            "graph-seed": d.graph_seed,
            "key-owners": _ids(owners),
            "share-keys": [d.keys[o].share_key for o in owners],
            "mask-keys": [k for o in owners for k in d.keys[o].mask_keys],
            "departments": [d.keys[o].department for o in owners],
            "signatures": [d.keys[o].signature for o in owners],
        }
    )


def decode_directory(record: ConfigRecord, *, slots: int) -> KeyDirectory:
    owners = _read_ids(record, "key-owners")
    share_keys = _get(record, "share-keys", list)
    mask_keys = _get(record, "mask-keys", list)
    signatures = _get(record, "signatures", list)
    raw = record.get("departments")
    if not isinstance(raw, list) or not all(isinstance(d, str) for d in raw):
        raise SecureAggregationError("secure-aggregation 'departments' must be a list of strings")
    departments = [str(d) for d in raw]
    if (len(share_keys) != len(owners) or len(mask_keys) != len(owners) * slots
            or len(signatures) != len(owners) or len(departments) != len(owners)):
        raise SecureAggregationError("key directory lists do not match its owners")
    keys = {
        o: KeyAdvertisement(o, share_keys[i], tuple(mask_keys[i * slots: (i + 1) * slots]), departments[i], signatures[i])
        for i, o in enumerate(owners)
    }
    return KeyDirectory(_get(record, "epoch", bytes), _read_ids(record, "members"), _get(record, "graph-seed", bytes), keys)


def encode_bundles(bundles: Sequence[ShareBundle]) -> ConfigRecord:
    return ConfigRecord({"recipients": _ids([b.recipient for b in bundles]), "ciphertexts": [b.ciphertext for b in bundles],
                         "commitments": [b.commitment for b in bundles]})


def decode_bundles(record: ConfigRecord, *, node: int) -> list[ShareBundle]:
    recipients = _read_ids(record, "recipients")
    ciphertexts, commitments = _get(record, "ciphertexts", list), _get(record, "commitments", list)
    if not len(recipients) == len(ciphertexts) == len(commitments):
        raise SecureAggregationError("share bundle lists differ in length")
    return [ShareBundle(node, r, c, m) for r, c, m in zip(recipients, ciphertexts, commitments, strict=True)]


# ---- rounds -----------------------------------------------------------------------------------
def encode_mask_request(r: MaskRequest, *, max_weight: float) -> ConfigRecord:
    return ConfigRecord(
        {
            "epoch": r.epoch,
            "slot": r.slot,
            "group": _ids(r.group),
            "senders": _ids([b.sender for b in r.incoming]),
            "ciphertexts": [b.ciphertext for b in r.incoming],
            "commitments": [b.commitment for b in r.incoming],
            "max-weight": max_weight,
        }
    )


def decode_mask_request(record: ConfigRecord, *, node: int) -> tuple[MaskRequest, float]:
    senders = _read_ids(record, "senders")
    ciphertexts, commitments = _get(record, "ciphertexts", list), _get(record, "commitments", list)
    if not len(senders) == len(ciphertexts) == len(commitments):
        raise SecureAggregationError("mask request bundle lists differ in length")
    incoming = tuple(ShareBundle(s, node, c, m) for s, c, m in zip(senders, ciphertexts, commitments, strict=True))
    request = MaskRequest(_get(record, "epoch", bytes), _slot(record), _read_ids(record, "group"), incoming)
    return request, float(_get(record, "max-weight", float))


def encode_masked(vector: NDArray[np.unsignedinteger], *, epoch: bytes, slot: int) -> tuple[ArrayRecord, ConfigRecord]:
    return ArrayRecord({"masked": Array(np.ascontiguousarray(vector))}), ConfigRecord({"epoch": epoch, "slot": slot})


def decode_masked(arrays: ArrayRecord, record: ConfigRecord) -> tuple[NDArray[np.generic], bytes, int]:
    if list(arrays.keys()) != ["masked"]:
        raise SecureAggregationError("masked reply must hold exactly one array named 'masked'")
    try:
        vector = arrays["masked"].numpy()
    except Exception as exc:  # a malformed array from a remote node
        raise SecureAggregationError(f"masked vector cannot be decoded ({exc})") from exc
    if vector.ndim != 1:
        raise SecureAggregationError(f"masked vector must be one-dimensional, got shape {vector.shape}")
    return vector, _get(record, "epoch", bytes), _slot(record)


def encode_unmask_request(r: UnmaskRequest) -> ConfigRecord:
    sizes = [len(part) for group in r.groups for part in group]
    nodes = [n for group in r.groups for part in group for n in part]
    signers = sorted(r.confirmations)
    return ConfigRecord({"epoch": r.epoch, "slot": r.slot, "sizes": sizes, "nodes": _ids(nodes),
                         "signers": _ids(signers), "signatures": [r.confirmations[n] for n in signers]})


def decode_unmask_request(record: ConfigRecord) -> UnmaskRequest:
    raw = record.get("sizes")
    if not isinstance(raw, list) or len(raw) % 2:
        raise SecureAggregationError("unmask request 'sizes' must be pairs of counts")
    sizes = [s for s in raw if isinstance(s, int) and not isinstance(s, bool) and s >= 0]
    if len(sizes) != len(raw):
        raise SecureAggregationError("unmask request 'sizes' must be pairs of counts")
    nodes = _read_ids(record, "nodes")
    if sum(sizes) != len(nodes):
        raise SecureAggregationError("unmask request sizes do not add up to its nodes")
    parts: list[tuple[int, ...]] = []
    offset = 0
    for size in sizes:
        parts.append(nodes[offset: offset + size])
        offset += size
    groups = tuple((parts[i], parts[i + 1]) for i in range(0, len(parts), 2))
    signers = _read_ids(record, "signers")
    signatures = _get(record, "signatures", list) if signers else []
    if len(signers) != len(signatures) or len(set(signers)) != len(signers):
        raise SecureAggregationError("unmask request signers and signatures do not match")
    return UnmaskRequest(_get(record, "epoch", bytes), _slot(record), groups,
                         dict(zip(signers, signatures, strict=True)))


def encode_confirmation(signature: bytes) -> ConfigRecord:
    return ConfigRecord({"signature": signature})


def decode_confirmation(record: ConfigRecord) -> bytes:
    signature = _get(record, "signature", bytes)
    if not 0 < len(signature) <= 512:
        raise SecureAggregationError("a confirmation signature must be 1-512 bytes")
    return bytes(signature)


def encode_unmask_reply(r: UnmaskReply) -> ConfigRecord:
    seeds, keys = sorted(r.seed_shares), sorted(r.key_shares)
    return ConfigRecord(
        {
            "seed-owners": _ids(seeds),
            "seed-shares": [share_to_bytes(r.seed_shares[o]) for o in seeds],
            "key-owners": _ids(keys),
            "key-shares": [share_to_bytes(r.key_shares[o]) for o in keys],
        }
    )


def decode_unmask_reply(record: ConfigRecord, *, node: int) -> UnmaskReply:
    def read(owners_key: str, shares_key: str) -> dict[int, int]:
        owners = _read_ids(record, owners_key)
        shares = _get(record, shares_key, list)
        if len(owners) != len(shares) or len(set(owners)) != len(owners):
            raise SecureAggregationError(f"unmask reply '{owners_key}' and '{shares_key}' do not match")
        return {o: share_from_bytes(s) for o, s in zip(owners, shares, strict=True)}

    return UnmaskReply(node, read("seed-owners", "seed-shares"), read("key-owners", "key-shares"))
