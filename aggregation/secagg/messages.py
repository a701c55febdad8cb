"""The masking protocol's parameters and the messages its stages exchange (plain, transport-free).

Node ids are Flower's uint64 node ids; inside an epoch a node is also known by its index in the
sorted member list, and index + 1 is its Shamir x-coordinate.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from quorumfl.aggregation.secagg.fixedpoint import FixedPoint
from quorumfl.aggregation.secagg.graph import (
    COMPLETE_UP_TO,
    neighbour_graph,
    neighbours_of,
    share_threshold,
)
from quorumfl.aggregation.secagg.streams import KEY_BYTES
from quorumfl.errors import ConfigError, SecureAggregationError

__all__ = [
    "EPOCH_BYTES",
    "EpochAnnouncement",
    "KeyAdvertisement",
    "KeyDirectory",
    "MaskRequest",
    "MaskingParams",
    "ShareBundle",
    "UnmaskReply",
    "UnmaskRequest",
    "announcement_terms",
    "finite_number",
    "pack_ids",
    "resolve_threshold",
    "unpack_ids",
    "whole_number",
]


def whole_number(value: object, name: str, *, low: int = -(2**63), high: int = 2**63 - 1) -> int:
    """A whole number read from a record another party wrote: an int (not a bool), or a float with a
    whole value, within [low, high]; ``ValueError`` naming ``name`` otherwise (never the
    ``OverflowError`` that ``int(inf)`` or a later ``to_bytes`` would raise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a whole number, got {type(value).__name__}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"{name} must be a finite whole number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value!r}")
    return int(value)


def finite_number(value: object, name: str) -> float:
    """A finite number read from a record another party wrote; ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def pack_ids(values: Sequence[int]) -> bytes:
    """Node ids (Flower's are unsigned 64-bit) as big-endian 8-byte words, as the wire and a node's
    stored state carry them."""
    try:
        return struct.pack(f">{len(values)}Q", *values)
    except struct.error as exc:  # negative, too large, or not an integer
        raise OverflowError(f"node ids must be unsigned 64-bit integers ({exc})") from None


def unpack_ids(data: bytes) -> tuple[int, ...]:
    """The ids ``pack_ids`` wrote; ``ValueError`` when ``data`` is not whole 8-byte words."""
    if len(data) % 8:
        raise ValueError("node ids must be whole 8-byte words")
    return struct.unpack(f">{len(data) // 8}Q", data)

EPOCH_BYTES = 16


def resolve_threshold(value: float, n: int) -> int:
    """An absolute threshold (value ≥ 1, an integer) or a fraction of ``n`` (0.5 < value < 1), as t."""
    if value >= 1:
        if value != int(value):
            raise ConfigError(f"an absolute threshold must be a whole number, got {value}")
        return int(value)
    if not 0.5 < value < 1:
        raise ConfigError(f"a fractional threshold must be in (0.5, 1), got {value}; t must be a majority")
    return max(n // 2 + 1, math.ceil(value * n))


@dataclass(frozen=True)
class MaskingParams:
    """One key epoch's settings, fixed at the announcement.

    ``threshold`` is t: shares needed to rebuild any secret (a majority of the cohort, at least 2).
    ``min_group`` is the fewest surviving members for which a group's sum is revealed (normally t).
    ``slots`` is how many rounds the epoch's pre-shared keys serve: each round uses a fresh slot.
    """

    threshold: int
    slots: int
    modulus_bits: int = 32
    clip: float = 8.0
    min_group: int = 0  # 0 means "the threshold"
    complete_up_to: int = COMPLETE_UP_TO
    colluding_fraction: float = 0.2  # assumed colluders, for the sparse graph's degree (graph.py)
    dropout_fraction: float = 0.1  # assumed dropouts, likewise

    @property
    def group_quorum(self) -> int:
        return self.min_group or self.threshold

    def check(self, n: int) -> None:
        """Every problem with these parameters for a cohort of ``n``, raised together."""
        problems: list[str] = []
        if n < 2:
            problems.append(f"secure aggregation needs at least 2 nodes, got {n}")
        if not n // 2 + 1 <= self.threshold <= n or self.threshold < 2:
            problems.append(
                f"threshold {self.threshold} must be a majority of the {n} nodes and at least 2 "
                f"(between {max(2, n // 2 + 1)} and {n})"
            )
        if not 2 <= self.group_quorum <= max(self.threshold, 2):
            problems.append(f"min group {self.group_quorum} must be between 2 and the threshold {self.threshold}")
        if not 0 <= self.colluding_fraction < 0.5 or not 0 <= self.dropout_fraction < 0.5:
            problems.append(f"colluding and dropout fractions must be in [0, 0.5), got {self.colluding_fraction} "
                            f"and {self.dropout_fraction}")
        if not 1 <= self.slots <= 10_000:
            problems.append(f"slots (rounds per key epoch) must be in [1, 10000], got {self.slots}")
        if problems:
            raise ConfigError(problems)
        self.fixed_point(n)

    def graph(self, n: int, seed: bytes) -> list[frozenset[int]]:
        return neighbour_graph(n, seed=seed, complete_up_to=self.complete_up_to,
                               colluding_fraction=self.colluding_fraction, dropout_fraction=self.dropout_fraction)

    def neighbours_of(self, index: int, n: int, seed: bytes) -> frozenset[int]:
        return neighbours_of(index, n, seed=seed, complete_up_to=self.complete_up_to,
                             colluding_fraction=self.colluding_fraction, dropout_fraction=self.dropout_fraction)

    def local_threshold(self, n: int, holders: int) -> int:
        return share_threshold(self.threshold, n, holders, colluding_fraction=self.colluding_fraction,
                               dropout_fraction=self.dropout_fraction)

    def fixed_point(self, n: int) -> FixedPoint:
        return FixedPoint(modulus_bits=self.modulus_bits, clip=self.clip, max_summands=n)

    def to_dict(self) -> dict[str, int | float]:
        return {
            "threshold": self.threshold, "slots": self.slots, "modulus-bits": self.modulus_bits,
            "clip": self.clip, "min-group": self.min_group, "complete-up-to": self.complete_up_to,
            "colluding-fraction": self.colluding_fraction, "dropout-fraction": self.dropout_fraction,
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, object]) -> MaskingParams:
        try:
            return cls(
                threshold=whole_number(values["threshold"], "threshold"),
                slots=whole_number(values["slots"], "slots"),
                modulus_bits=whole_number(values["modulus-bits"], "modulus-bits"),
                clip=finite_number(values["clip"], "clip"),
                min_group=whole_number(values["min-group"], "min-group"),
                complete_up_to=whole_number(values["complete-up-to"], "complete-up-to"),
                colluding_fraction=finite_number(values["colluding-fraction"], "colluding-fraction"),
                dropout_fraction=finite_number(values["dropout-fraction"], "dropout-fraction"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SecureAggregationError(f"malformed secure-aggregation parameters ({exc})") from exc


@dataclass(frozen=True)
class EpochAnnouncement:
    """Stage 1, server → each cohort node: start a key epoch."""

    epoch: bytes
    cohort: tuple[int, ...]
    params: MaskingParams


def announcement_terms(params: MaskingParams, cohort: Sequence[int]) -> bytes:
    """SHA-256 of an epoch's parameters and cohort in one canonical form. Every node signs it inside
    its key advertisement, so a peer's signature verifies only if both were announced the same
    parameters and cohort: a server that tells one node a lower threshold or a smaller group than
    the others is caught at the share stage."""
    canonical = json.dumps(params.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"quorumfl-secagg-terms-v1" + len(canonical).to_bytes(4, "big") + canonical
                          + pack_ids(cohort)).digest()


@dataclass(frozen=True)
class KeyAdvertisement:
    """Stage 1, node → server: the node's public keys (one for share encryption, one per slot),
    signed with the department's registered node key (``identity``; empty in an unsigned federation)."""

    node: int
    share_key: bytes
    mask_keys: tuple[bytes, ...]
    department: str = ""
    signature: bytes = b""

    def check(self, slots: int) -> None:
        if len(self.share_key) != KEY_BYTES or len(self.mask_keys) != slots:
            raise SecureAggregationError(f"advertisement must hold 1 + {slots} keys", node=str(self.node))
        if any(len(k) != KEY_BYTES for k in self.mask_keys):
            raise SecureAggregationError(f"every public key is {KEY_BYTES} bytes", node=str(self.node))


@dataclass(frozen=True)
class KeyDirectory:
    """Stage 2, server → node: who advertised, the graph seed, and the neighbours' public keys."""

    epoch: bytes
    members: tuple[int, ...]
    graph_seed: bytes
    keys: Mapping[int, KeyAdvertisement]


@dataclass(frozen=True)
class ShareBundle:
    """Stage 2, node → server → recipient: the sender's shares for the recipient, AEAD-encrypted,
    and in the clear the sender's commitments to them (``share_commitment`` of the key share and of
    the seed share, per slot), so the server can check each share revealed at unmasking."""

    sender: int
    recipient: int
    ciphertext: bytes
    commitment: bytes = b""


COMMITMENT_BYTES = 32


def share_commitment(*, epoch: bytes, owner: int, holder: int, slot: int, seed: bool, share: bytes) -> bytes:
    """SHA-256 commitment to one Shamir share (a uniform 66-byte field element, so it hides it)."""
    label = b"quorumfl-secagg-share-commitment-v1" + (b"seed" if seed else b"key")
    return hashlib.sha256(label + epoch + owner.to_bytes(8, "big") + holder.to_bytes(8, "big")
                          + slot.to_bytes(4, "big") + share).digest()


@dataclass(frozen=True)
class MaskRequest:
    """With a round's train message: the slot, the node's group, and share bundles not yet delivered."""

    epoch: bytes
    slot: int
    group: tuple[int, ...]
    incoming: tuple[ShareBundle, ...] = ()


@dataclass(frozen=True)
class UnmaskRequest:
    """After the masked inputs: per group, who survived and who dropped. One request for all survivors.

    In a signed epoch the same view first goes out alone (the consistency stage): each survivor signs
    it, and the unmask request then carries those signatures (``confirmations``: node → signature),
    so a node reveals shares only for a view that enough others confirmed too."""

    epoch: bytes
    slot: int
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (survivors, dropped) per group
    confirmations: Mapping[int, bytes] = field(default_factory=dict)

    def view(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """The survivor/dropped sets in one canonical order (what a node signs)."""
        return tuple(sorted((tuple(sorted(a)), tuple(sorted(d))) for a, d in self.groups))

    def needs_confirmations(self, *, complete: bool) -> bool:
        """Whether, in a signed epoch, this view is unmasked only with the survivors' signatures (a
        consistency stage first): when it names a dropped node (it then asks for slot-key shares) or
        the epoch's graph is not complete. The one rule the server, the nodes and the tests apply;
        ``NodeEpoch.unmask`` has why a no-dropout view on the complete graph needs none."""
        return not complete or any(gone for _, gone in self.groups)


@dataclass(frozen=True)
class UnmaskReply:
    """A survivor's shares: self-mask seeds of survivors and slot keys of dropped nodes it holds."""

    node: int
    seed_shares: Mapping[int, int]
    key_shares: Mapping[int, int]
