"""Dealer-free key ceremony for threshold CKKS (semi-honest, commit-then-reveal), and the key share it leaves.

Three stages, each one message round trip, for members m_1..m_n (party index x_i = i):

1. ``commit``: party i samples s_i with SEAL's KeyGenerator and e_i with SEAL's encryption of zero
   at the key level (c0 + c1·s_i = −e_i), computes its public share b_i = −e_i − a·s_i for the
   common uniform a (expanded from the announcement's seed), and sends only H(b_i) and an X25519
   key for share transport, signed with its registered node key (department, ceremony, digest and
   transport key), so the server can substitute neither.
2. ``reveal``: given every commitment — each signature checked against the admin's roster — it
   reveals b_i and sends each member p an encrypted Shamir share f_i(x_p) of s_i (one degree t−1
   polynomial per data prime and NTT coordinate: decryptions never use the special prime, so
   shares leave it out, a third less to relay at three primes).
3. ``finish``: given the revealers R, their b_j and the bundles addressed to it, it checks every
   H(b_j) against the commitment, keeps its share f_j(x_p) of every revealer's secret (a round
   decrypts the sum of its contributors' secrets, ``threshold``) and its own s_p, and computes the
   joint public key pk = (Σ_{j∈R} b_j, a), whose hash names the key; σ_p = Σ_{j∈R} f_j(x_p) (derived,
   ``KeyShare.share``) is its share of s = Σ s_j.

Commitments before reveal stop a late party from choosing b_i as a function of the others'
(e.g. to cancel them and plant a key it knows). Without a dealer nobody ever holds s; any t of
the σ_p rebuild it, t − 1 reveal nothing (Shamir). Not covered (semi-honest model): a party that
sends inconsistent shares (that would need verifiable secret sharing).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from quorumfl.aggregation.ckks.params import CkksParams
from quorumfl.aggregation.ckks.rns import add_mod, add_mod_into, mul_mod, shamir_shares, sub_mod
from quorumfl.aggregation.ckks.seal import Seal
from quorumfl.aggregation.secagg.identity import Roster, field_bytes
from quorumfl.aggregation.secagg.streams import (
    decrypt_bundle,
    encrypt_bundle,
    new_private_key,
    public_key,
)
from quorumfl.errors import ConfigError, SecureAggregationError

__all__ = [
    "Announcement",
    "BundleStore",
    "CeremonyCoordinator",
    "Commitment",
    "KeyParty",
    "KeyShare",
    "MemoryBundles",
    "Reveal",
    "ceremony_in_one_process",
    "commitment_message",
    "expand_uniform",
    "public_key_id",
]

U64 = NDArray[np.uint64]


def expand_uniform(seed: bytes, primes: Sequence[int], degree: int) -> U64:
    """The common polynomial a: uniform residues ``[prime, coeff]`` from SHAKE-256(seed), by rejection."""
    out = np.empty((len(primes), degree), dtype=np.uint64)
    for j, q in enumerate(primes):
        mask = np.uint64((1 << int(q).bit_length()) - 1)
        got: list[U64] = []
        have, counter = 0, 0
        while have < degree:
            stream = hashlib.shake_256(seed + j.to_bytes(2, "big") + counter.to_bytes(4, "big")).digest(8 * (degree + 256))
            draw = np.frombuffer(stream, dtype="<u8").astype(np.uint64) & mask
            keep = draw[draw < np.uint64(q)]
            got.append(keep)
            have += keep.size
            counter += 1
        out[j] = np.concatenate(got)[:degree]
    return out


def _digest(ceremony: bytes, index: int, b: U64) -> bytes:
    return hashlib.sha256(b"quorumfl/ckks/commit" + ceremony + index.to_bytes(4, "big") + b.astype("<u8").tobytes()).digest()


_COMMIT_CONTEXT = b"quorumfl-ckks-commitment-v1"


def commitment_message(*, binding: bytes, ceremony: bytes, terms: bytes, node: int, department: str, digest: bytes,
                       transport_key: bytes) -> bytes:
    """The bytes a member signs for its commitment (length-prefixed fields: unambiguous); ``terms``
    is the digest of the ceremony's members, threshold, parameters and seed as this member was told
    them (``ceremony_terms``), so members told different ones refuse each other's commitments."""
    parts = [_COMMIT_CONTEXT, binding, ceremony, terms, node.to_bytes(8, "big"), department.encode(), digest,
             transport_key]
    return b"".join(field_bytes(p) for p in parts)


def public_key_id(public_key: bytes) -> str:
    """The key's name everywhere (files, manifests, the CLI): the first 16 bytes of SHA-256, hex."""
    return hashlib.sha256(public_key).hexdigest()[:32]


@dataclass(frozen=True)
class Announcement:
    """What the server fixes for a ceremony: who, t of n, parameters, the seed of a."""

    ceremony: bytes
    members: tuple[int, ...]
    threshold: int
    params: CkksParams
    seed: bytes

    def __post_init__(self) -> None:
        problems = []
        if len(self.ceremony) != 16 or len(self.seed) != 32:
            problems.append("ceremony id must be 16 bytes and seed 32 bytes")
        if len(set(self.members)) != len(self.members) or list(self.members) != sorted(self.members):
            problems.append("ceremony members must be distinct and sorted")
        if not (len(self.members) // 2 + 1 <= self.threshold <= len(self.members)) or self.threshold < 2:
            problems.append(
                f"threshold {self.threshold} must be a majority of the {len(self.members)} members and at least 2"
            )
        if problems:
            raise ConfigError(problems)

    @classmethod
    def new(cls, members: Sequence[int], threshold: int, params: CkksParams) -> Announcement:
        return cls(os.urandom(16), tuple(sorted(members)), threshold, params, os.urandom(32))

    def index(self, node: int) -> int:
        if node not in self.members:
            raise SecureAggregationError(f"node {node} is not a member of this key ceremony")
        return self.members.index(node) + 1

    def terms(self) -> bytes:
        """SHA-256 of the members, t, the parameters and the seed of a, in one canonical form."""
        params = json.dumps(self.params.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        ids = b"".join(m.to_bytes(8, "big") for m in self.members)
        return hashlib.sha256(b"".join(field_bytes(p) for p in (
            b"quorumfl-ckks-ceremony-terms-v1", ids, self.threshold.to_bytes(4, "big"), params, self.seed))).digest()


@dataclass(frozen=True)
class Commitment:
    node: int
    digest: bytes
    transport_key: bytes  # X25519 public key for share bundles
    department: str = ""  # roster name the signature is checked under ("" in an unsigned federation)
    signature: bytes = b""

    def verify(self, roster: Roster, *, binding: bytes, announcement: Announcement) -> None:
        """Raise unless the commitment is signed by its department's registered key, for the
        ceremony as ``announcement`` states it."""
        roster.check(self.department, commitment_message(
            binding=binding, ceremony=announcement.ceremony, terms=announcement.terms(), node=self.node,
            department=self.department, digest=self.digest, transport_key=self.transport_key), self.signature,
            node=self.node)


@dataclass(frozen=True)
class Reveal:
    node: int
    b: U64  # public share, key level [prime, coeff]
    bundles: dict[int, bytes]  # recipient node -> encrypted share


@dataclass(frozen=True)
class KeyShare:
    """What a member keeps (secret: its node's key store): its own ceremony secret s_i and its share of
    every holder's secret, at the data primes (the special prime is only ever in the public key),
    the public key, the members."""

    key_id: str
    ceremony: bytes
    node: int
    index: int
    members: tuple[int, ...]  # indices are positions + 1 (decryptors are named by node id)
    holders: tuple[int, ...]  # members that finished the ceremony (can decrypt)
    threshold: int
    params: CkksParams
    public_key: bytes
    secret: U64  # s_i, data primes [prime, coeff] (NTT): encrypts this member's updates
    dealt: U64  # f_j(x_i) for each holder j in ``holders`` order, data primes [holder, prime, coeff]

    @property
    def share(self) -> U64:
        """σ_i = Σ_j f_j(x_i) over every holder: this member's share of s = Σ s_j (data primes)."""
        return self.shares_of(self.holders, self.dealt.shape[1])

    def shares_of(self, contributors: Sequence[int], primes: int) -> U64:
        """σ_i(C) = Σ_{j∈C} f_j(x_i) at the first ``primes`` primes: this member's share of s_C."""
        if primes > self.dealt.shape[1]:
            raise SecureAggregationError(f"no ciphertext level with {primes} primes under key {self.key_id}")
        rows = []
        for node in contributors:
            if node not in self.holders:
                raise SecureAggregationError(f"node {node} holds no share of key {self.key_id}", node=str(node))
            rows.append(self.holders.index(node))
        level = Seal.of(self.params).primes_at(primes)
        total = np.zeros((primes, self.params.poly_degree), dtype=np.uint64)
        for row in sorted(set(rows)):
            add_mod_into(total, np.ascontiguousarray(self.dealt[row, :primes]), level)
        return total


@dataclass
class KeyParty:
    """One member's ceremony state between stages (secret: keep it on the node)."""

    announcement: Announcement
    node: int
    secret: U64
    b: U64
    transport_private: bytes
    commitments: dict[int, Commitment] = field(default_factory=dict)
    own_share: U64 | None = None

    @classmethod
    def commit(cls, announcement: Announcement, node: int, *, signer: Callable[[bytes], bytes] | None = None,
               department: str = "", binding: bytes = b"") -> tuple[KeyParty, Commitment]:
        """Stage 1; with ``signer`` (a signed federation) the commitment carries the node's signature."""
        index = announcement.index(node)
        seal = Seal.of(announcement.params)
        key_primes = seal.primes
        secret_key, secret = seal.new_secret()
        zero = seal.zero_encryption(secret_key)  # c0 + c1·s = −e
        a = expand_uniform(announcement.seed, key_primes, announcement.params.poly_degree)
        c0, c1 = zero.polys[0], zero.polys[1]
        b = add_mod(c0, mul_mod(sub_mod(c1, a, key_primes), secret, key_primes), key_primes)  # −e − a·s
        private = new_private_key()
        party = cls(announcement, node, secret, b, private)
        digest, transport = _digest(announcement.ceremony, index, b), public_key(private)
        signature = b"" if signer is None else signer(commitment_message(
            binding=binding, ceremony=announcement.ceremony, terms=announcement.terms(), node=node,
            department=department, digest=digest, transport_key=transport))
        return party, Commitment(node, digest, transport, department, signature)

    def reveal(self, commitments: Mapping[int, Commitment], *, roster: Roster | None = None,
               binding: bytes = b"") -> Reveal:
        """Stage 2: reveal b and send each committed member its encrypted share of s_i.

        With ``roster`` (a signed federation) every commitment must verify under its department's
        registered key and name a distinct department, or nothing is revealed: a transport key
        the server substituted would let it read the shares.
        """
        ann = self.announcement
        if self.node not in commitments or commitments[self.node].digest != _digest(ann.ceremony, ann.index(self.node), self.b):
            raise SecureAggregationError("the directory does not carry this node's own commitment")
        if len(commitments) < ann.threshold:
            raise SecureAggregationError(f"only {len(commitments)} members committed; {ann.threshold} are needed")
        for node in commitments:
            ann.index(node)
        if roster is not None:
            for commitment in commitments.values():
                commitment.verify(roster, binding=binding, announcement=ann)
            departments = [c.department for c in commitments.values()]
            if len(set(departments)) != len(departments):
                raise SecureAggregationError("two members of the ceremony claim one department; refusing")
        self.commitments = dict(commitments)
        seal = Seal.of(ann.params)
        recipients = sorted(commitments)
        data = seal.primes_at(len(ann.params.data_bits))  # decryptions never use the special prime
        shares = shamir_shares(np.ascontiguousarray(self.secret[: len(data)]), [ann.index(n) for n in recipients],
                               ann.threshold, data)
        bundles: dict[int, bytes] = {}
        for node, share in zip(recipients, shares, strict=True):
            if node == self.node:
                self.own_share = share
                continue
            bundles[node] = encrypt_bundle(
                share.astype("<u8").tobytes(), private=self.transport_private,
                peer_public=commitments[node].transport_key, epoch=ann.ceremony, sender=self.node, recipient=node,
            )
        return Reveal(self.node, self.b, bundles)

    def finish(self, revealers: Mapping[int, U64], bundles: Mapping[int, bytes]) -> KeyShare:
        """Stage 3: check reveals against commitments, keep every revealer's share, build the joint public key."""
        ann = self.announcement
        if self.own_share is None or self.node not in revealers:
            raise SecureAggregationError("this node did not reveal in this ceremony; it cannot hold a share")
        if len(revealers) < ann.threshold:
            raise SecureAggregationError(f"only {len(revealers)} members revealed; {ann.threshold} are needed")
        seal = Seal.of(ann.params)
        primes = seal.primes
        shape = (len(primes), ann.params.poly_degree)
        data = seal.primes_at(len(ann.params.data_bits))
        share_shape = (len(data), ann.params.poly_degree)
        total_b = np.zeros(shape, dtype=np.uint64)
        dealt = np.empty((len(revealers), *share_shape), dtype=np.uint64)
        for row, node in enumerate(sorted(revealers)):
            if node not in self.commitments:
                raise SecureAggregationError(f"node {node} revealed without having committed")
            b = revealers[node]
            if b.shape != shape or bool(np.any(b >= np.asarray(primes, dtype=np.uint64)[:, None])):
                raise SecureAggregationError(f"public share of node {node} is malformed")
            expected = self.commitments[node].digest
            if not hmac.compare_digest(_digest(ann.ceremony, ann.index(node), b), expected):
                raise SecureAggregationError(f"public share of node {node} does not match its commitment")
            total_b = add_mod(total_b, b, primes)
            if node == self.node:
                dealt[row] = self.own_share
                continue
            if node not in bundles:
                raise SecureAggregationError(f"no share bundle from node {node}, which revealed")
            raw = decrypt_bundle(
                bundles[node], private=self.transport_private, peer_public=self.commitments[node].transport_key,
                epoch=ann.ceremony, sender=node, recipient=self.node,
            )
            if len(raw) != 8 * share_shape[0] * share_shape[1]:
                raise SecureAggregationError(f"share from node {node} has the wrong size")
            part = np.frombuffer(raw, dtype="<u8").astype(np.uint64).reshape(share_shape)
            if bool(np.any(part >= np.asarray(data, dtype=np.uint64)[:, None])):
                raise SecureAggregationError(f"share from node {node} is not reduced")
            dealt[row] = part
        a = expand_uniform(ann.seed, primes, ann.params.poly_degree)
        pk = seal.public_key(total_b, a)
        return KeyShare(
            key_id=public_key_id(pk), ceremony=ann.ceremony, node=self.node, index=ann.index(self.node),
            members=ann.members, holders=tuple(sorted(revealers)), threshold=ann.threshold, params=ann.params,
            public_key=pk, secret=np.ascontiguousarray(self.secret[: len(data)]), dealt=dealt,
        )


class BundleStore(Protocol):
    """Where the coordinator keeps the encrypted share bundles between the reveal and finish stages:
    n·(n − 1) of them, 131 KB each at the default parameters (1.3 GB at 100 members), so the server
    keeps them on disk (``quorumfl.server.ckks``); ``MemoryBundles`` otherwise."""

    def put(self, sender: int, recipient: int, bundle: bytes) -> None: ...

    def inbox(self, recipient: int) -> dict[int, bytes]:
        """The bundles addressed to ``recipient``, by sender."""
        ...

    def size(self, recipient: int) -> int:
        """The bytes of ``recipient``'s inbox."""
        ...


class MemoryBundles:
    """Bundles kept in memory (one-process ceremonies, tests)."""

    def __init__(self) -> None:
        self._by_recipient: dict[int, dict[int, bytes]] = {}

    def put(self, sender: int, recipient: int, bundle: bytes) -> None:
        self._by_recipient.setdefault(recipient, {})[sender] = bundle

    def inbox(self, recipient: int) -> dict[int, bytes]:
        return dict(self._by_recipient.get(recipient, {}))

    def size(self, recipient: int) -> int:
        return sum(len(b) for b in self._by_recipient.get(recipient, {}).values())


class _Inbox(Mapping[int, dict[int, bytes]]):
    """Per revealer, the bundles addressed to it, read from the store when asked for."""

    def __init__(self, store: BundleStore, recipients: Sequence[int]) -> None:
        self._store = store
        self._recipients = tuple(recipients)

    def __getitem__(self, recipient: int) -> dict[int, bytes]:
        if recipient not in self._recipients:
            raise KeyError(recipient)
        return self._store.inbox(recipient)

    def __iter__(self) -> Iterator[int]:
        return iter(self._recipients)

    def __len__(self) -> int:
        return len(self._recipients)


class CeremonyCoordinator:
    """The server's side: routes commitments, reveals and bundles; computes the same public key; holds no secret.

    Each accepted reveal's bundles go to ``bundles`` (a ``BundleStore``; in memory unless given) and
    only its public share stays here, so the server's memory need not hold the n² bundles."""

    def __init__(self, announcement: Announcement, bundles: BundleStore | None = None) -> None:
        self.announcement = announcement
        self.bundles: BundleStore = bundles if bundles is not None else MemoryBundles()
        self.commitments: dict[int, Commitment] = {}
        self.public_shares: dict[int, U64] = {}  # each accepted revealer's b (its bundles are in ``bundles``)
        self.confirmed: list[int] = []
        self.public_key: bytes | None = None

    def add_commitment(self, commitment: Commitment) -> None:
        self.announcement.index(commitment.node)
        if len(commitment.digest) != 32 or len(commitment.transport_key) != 32:
            raise SecureAggregationError(f"commitment of node {commitment.node} is malformed")
        self.commitments[commitment.node] = commitment

    def directory(self) -> dict[int, Commitment]:
        if len(self.commitments) < self.announcement.threshold:
            raise SecureAggregationError(
                f"only {len(self.commitments)} of {len(self.announcement.members)} members committed; "
                f"the key needs {self.announcement.threshold}"
            )
        return dict(self.commitments)

    def add_reveal(self, reveal: Reveal) -> None:
        ann = self.announcement
        commitment = self.commitments.get(reveal.node)
        if commitment is None:
            raise SecureAggregationError(f"node {reveal.node} revealed without committing")
        if not hmac.compare_digest(_digest(ann.ceremony, ann.index(reveal.node), reveal.b), commitment.digest):
            raise SecureAggregationError(f"public share of node {reveal.node} does not match its commitment")
        if set(reveal.bundles) != set(self.commitments) - {reveal.node}:
            raise SecureAggregationError(f"node {reveal.node} did not send a share to every committed member")
        for recipient, bundle in reveal.bundles.items():
            self.bundles.put(reveal.node, recipient, bundle)
        self.public_shares[reveal.node] = reveal.b

    def finish_request(self) -> tuple[dict[int, U64], Mapping[int, dict[int, bytes]]]:
        """For stage 3: every revealer's b, and per revealer the bundles addressed to it from the
        other revealers (read from the store as each is asked for). Fixes pk."""
        ann = self.announcement
        if len(self.public_shares) < ann.threshold:
            raise SecureAggregationError(f"only {len(self.public_shares)} members revealed; the key needs {ann.threshold}")
        seal = Seal.of(ann.params)
        total = np.zeros((len(seal.primes), ann.params.poly_degree), dtype=np.uint64)
        for b in self.public_shares.values():
            total = add_mod(total, b, seal.primes)
        self.public_key = seal.public_key(total, expand_uniform(ann.seed, seal.primes, ann.params.poly_degree))
        return dict(self.public_shares), _Inbox(self.bundles, sorted(self.public_shares))

    def confirm(self, node: int, key_id: str) -> None:
        if self.public_key is None:
            raise SecureAggregationError("confirmation before the public key was fixed")
        if not hmac.compare_digest(key_id, public_key_id(self.public_key)):
            raise SecureAggregationError(f"node {node} computed a different public key")
        if node in self.public_shares and node not in self.confirmed:
            self.confirmed.append(node)

    @property
    def key_id(self) -> str:
        if self.public_key is None:
            raise SecureAggregationError("the ceremony has not fixed its public key yet")
        return public_key_id(self.public_key)


def ceremony_in_one_process(
    members: Sequence[int], threshold: int, params: CkksParams
) -> tuple[CeremonyCoordinator, dict[int, KeyParty], dict[int, KeyShare]]:
    """Every stage of every member in this process (simulation, tests, benchmarks).

    A deployment runs the same stages on the nodes, one message round trip each.
    """
    coordinator = CeremonyCoordinator(Announcement.new(members, threshold, params))
    parties: dict[int, KeyParty] = {}
    for node in coordinator.announcement.members:
        parties[node], commitment = KeyParty.commit(coordinator.announcement, node)
        coordinator.add_commitment(commitment)
    directory = coordinator.directory()
    for party in parties.values():
        coordinator.add_reveal(party.reveal(directory))
    reveals, inbox = coordinator.finish_request()
    shares = {node: party.finish(reveals, inbox[node]) for node, party in parties.items()}
    for node, share in shares.items():
        coordinator.confirm(node, share.key_id)
    return coordinator, parties, shares
