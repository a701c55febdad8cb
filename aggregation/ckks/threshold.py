"""Threshold-CKKS rounds: encrypt an update, add ciphertexts, decrypt with t partial decryptions.

- A node encrypts its payload vector in chunks of N values (two per complex slot) under the joint
  public key, at the fewest primes that hold the sum (``CkksParams.send_primes``); it is
  ``[chunk, 2, prime, coeff]`` and travels with its residues packed at 60 bits (``packing``).
- The server adds ciphertexts as they arrive (a running sum mod each prime: memory is one
  aggregate, not one per node), then fixes the decrypting subset S (|S| ≥ t) and sends each
  member of S the aggregate's c1 with a ``Manifest``.
- Member p answers d_p = λ_p(S)·σ_p·c1 + NTT(e_p), λ_p the Lagrange coefficient at 0 over S's
  indices, applied *before* the flooding noise e_p ∈ [−B, B) is added (multiplying noise by λ
  afterwards would blow it up to the size of q).
- The server combines m = c0 + Σ_{p∈S} d_p = Δ·Σx + small noise and decodes.

A member refuses (fails closed): a manifest for another key, fewer than t contributors (or than the
run's signed ``secagg-min-group``, at least 2, where the admin set one: IFCA sums each cluster on its own), |S| < t,
itself not in S, S outside the key's holders, a c1 whose digest differs from the manifest's, any
second request for the same (round, group) — decrypting one aggregate twice would let the server
average the flooding away, and decrypting two sums over different contributors of one round would
reveal their difference — more decryptions under one key than the run's cap, and a c1 it cannot
tie to the contributors' own ciphertexts.

Tying c1 to contributors (an active server could otherwise send a crafted c1, e.g. a large
constant K, and read s·K — the joint secret key — off the partial decryptions). Sending every
contributor's signed c1_i to every decryptor would be sound but costs contributors × |c1| per
decryptor (36 MB per contributor for a 1.1M-parameter model), so instead:

- each contributor i computes τ_i = ⟨R, c1_i⟩ mod q per prime, R a vector of 40-bit words from
  ChaCha20 keyed by the members' MAC key (``KeyShare.mac_key``, agreed in the ceremony over the
  pairwise-encrypted bundles, never seen by the server) and (key, round, group); it seals τ_i with
  ChaCha20-Poly1305 under a key derived the same way and signs (run, key, round, group, node,
  department, sealed tag) with its registered node key — about 170 bytes per contributor;
- the server relays every contributor's sealed, signed tag with the decryption request; a
  decryptor checks each signature against the roster, opens the tags and decrypts only if
  ⟨R, c1⟩ = Σ τ_i for every prime.

A c1 ≠ Σ c1_i passes with probability at most 2^−40 per prime (R's coordinate at any position where
they differ has 2^40 equally likely values, at most one of which works), independently per prime,
and the server gets one try per (key, round, group) — the ledger refuses a second; the tags are
sealed so the server cannot pick a combination of the contributors' own ciphertexts that passes.
Not covered: a member colluding with the server knows the MAC key and can choose its own c1_i after
seeing the others' (a proof that each c1_i is a well-formed encryption would be needed); against
colluding departments the masking mode holds.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from numpy.typing import NDArray

from quorumfl.aggregation.ckks.keys import KeyShare
from quorumfl.aggregation.ckks.params import CkksParams
from quorumfl.aggregation.ckks.rns import (
    add_mod,
    add_mod_into,
    flooding_noise,
    lagrange_at_zero,
    mul_scalar,
    reduced,
)
from quorumfl.aggregation.ckks.seal import Seal
from quorumfl.aggregation.secagg.identity import Roster, field_bytes
from quorumfl.errors import QuorumNotMetError, SecureAggregationError

__all__ = [
    "MAX_DECRYPTIONS",
    "CiphertextSum",
    "Contribution",
    "DecryptionSum",
    "Manifest",
    "c1_digest",
    "combine",
    "contribute",
    "encrypt_vector",
    "partial_decrypt",
]

U64 = NDArray[np.uint64]
MAX_DECRYPTIONS = 1000  # default cap on partial decryptions one key share answers (run key ckks-max-decryptions)
_TAG_BITS = 40
_CONTRIBUTION_CONTEXT = b"quorumfl-ckks-contribution-v1"
_NONCE = 12


def _round_keys(share: KeyShare, round_number: int, group: int) -> tuple[bytes, bytes]:
    """(ChaCha20 key for R, AEAD key for the sealed tags) of one key, round and group."""
    if len(share.mac_key) != 32:
        raise SecureAggregationError(f"key {share.key_id} has no MAC key (made before contributions were tied "
                                     "to decryptions); run a new key ceremony")
    info = b"quorumfl/ckks/round-keys" + share.key_id.encode() + round_number.to_bytes(8, "big", signed=True) \
        + group.to_bytes(4, "big", signed=True)
    both = HKDF(algorithm=hashes.SHA256(), length=64, salt=None, info=info).derive(share.mac_key)
    return both[:32], both[32:]


def _projection(key: bytes, c1: U64, primes: Sequence[int]) -> list[int]:
    """⟨R, c1⟩ mod q per prime, R 40-bit words of ChaCha20(key) (one stream per prime).

    numpy has no 128-bit product: the quotient ⌊c·r/q⌋ < 2^40 is estimated in float64 (off by at
    most one), so c·r − quotient·q, computed modulo 2^64, is the exact remainder up to one q
    either way and fits an int64; those are summed exactly as 30-bit halves and reduced once.
    """
    out = []
    for j, q in enumerate(primes):
        part = np.ascontiguousarray(c1[:, j, :]).reshape(-1)
        stream = Cipher(algorithms.ChaCha20(key, j.to_bytes(16, "little")), mode=None).encryptor()
        r = np.frombuffer(stream.update(bytes(8 * part.size)), dtype="<u8") & np.uint64((1 << _TAG_BITS) - 1)
        estimate = part.astype(np.float64)
        estimate *= r.astype(np.float64)
        estimate *= 1.0 / float(q)
        with np.errstate(over="ignore"):
            rem = part * r
            rem -= estimate.astype(np.uint64) * np.uint64(q)
        signed = rem.view(np.int64)  # in (−q, 2q): exact
        high = int(np.sum(signed >> np.int64(30), dtype=np.int64))
        low = int(np.sum(signed & np.int64((1 << 30) - 1), dtype=np.int64))
        out.append((high * (1 << 30) + low) % int(q))
    return out


def _aad(share: KeyShare, round_number: int, group: int, node: int) -> bytes:
    return share.key_id.encode() + round_number.to_bytes(8, "big", signed=True) + group.to_bytes(4, "big", signed=True) \
        + node.to_bytes(8, "big")


def contribution_message(*, binding: bytes, key_id: str, round_number: int, group: int, node: int, department: str,
                         sealed: bytes) -> bytes:
    """The bytes a contributor signs for its encrypted update's tag (length-prefixed fields)."""
    parts = [_CONTRIBUTION_CONTEXT, binding, key_id.encode(), round_number.to_bytes(8, "big", signed=True),
             group.to_bytes(4, "big", signed=True), node.to_bytes(8, "big"), department.encode(), sealed]
    return b"".join(field_bytes(p) for p in parts)


@dataclass(frozen=True)
class Contribution:
    """What ties one contributor's ciphertext to the decryption of the sum: its sealed tag, signed."""

    node: int
    department: str
    sealed: bytes  # nonce ‖ ChaCha20-Poly1305(⟨R, c1_i⟩ per prime)
    signature: bytes  # b"" in an unsigned federation


def contribute(share: KeyShare, c1: U64, *, round_number: int, group: int,
               signer: Callable[[bytes], bytes] | None = None, department: str = "", binding: bytes = b"") -> Contribution:
    """A member's tag for its own ciphertext's c1 ([chunk, prime, coeff]) in (round, group)."""
    primes = Seal.of(share.params).primes_at(c1.shape[1])
    prg, aead = _round_keys(share, round_number, group)
    tag = b"".join(v.to_bytes(8, "big") for v in _projection(prg, c1, primes))
    nonce = os.urandom(_NONCE)
    sealed = nonce + ChaCha20Poly1305(aead).encrypt(nonce, tag, _aad(share, round_number, group, share.node))
    signature = b"" if signer is None else signer(contribution_message(
        binding=binding, key_id=share.key_id, round_number=round_number, group=group, node=share.node,
        department=department, sealed=sealed))
    return Contribution(share.node, department, sealed, signature)


def encrypt_vector(params: CkksParams, public_key: bytes, values: NDArray[np.float64], *, primes: int) -> U64:
    """``values`` encrypted under ``public_key`` as ``[chunk, 2, prime, coeff]`` at ``primes`` primes."""
    if not np.all(np.isfinite(values)):
        raise SecureAggregationError("the vector to encrypt has non-finite values")
    return Seal.of(params).encrypt(public_key, np.asarray(values, dtype=np.float64), primes)


def c1_digest(c1: U64) -> str:
    return hashlib.sha256(np.ascontiguousarray(c1, dtype="<u8").tobytes()).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """What a decryptor is asked to decrypt, fixed by the server before anyone answers."""

    key_id: str
    round: int
    group: int
    contributors: tuple[int, ...]
    subset: tuple[int, ...]  # decryptors, by node id
    length: int  # values in the aggregate
    digest: str  # SHA-256 of c1

    def to_dict(self) -> dict[str, object]:
        return {"key_id": self.key_id, "round": self.round, "group": self.group, "contributors": list(self.contributors),
                "subset": list(self.subset), "length": self.length, "digest": self.digest}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Manifest:
        try:
            contributors = data["contributors"]
            subset = data["subset"]
            if not isinstance(contributors, list) or not isinstance(subset, list):
                raise TypeError("contributors and subset must be lists")
            return cls(
                key_id=str(data["key_id"]), round=int(data["round"]), group=int(data["group"]),  # type: ignore[call-overload]
                contributors=tuple(int(c) for c in contributors), subset=tuple(int(s) for s in subset),
                length=int(data["length"]), digest=str(data["digest"]),  # type: ignore[call-overload]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SecureAggregationError(f"decryption manifest is malformed ({exc})") from exc


class CiphertextSum:
    """Running homomorphic sum of one group's encrypted vectors (the server's only CKKS state)."""

    def __init__(self, params: CkksParams, *, length: int, primes: int) -> None:
        seal = Seal.of(params)
        self.params = params
        self.length = length
        self.primes = seal.primes_at(primes)
        self.shape = (params.chunks(length), 2, primes, params.poly_degree)
        self.total = np.zeros(self.shape, dtype=np.uint64)
        self.contributors: list[int] = []

    def add(self, node: int, polys: U64) -> None:
        """Check and add one node's ciphertexts; a malformed one is refused whole (nothing added)."""
        if node in self.contributors:
            raise SecureAggregationError(f"node {node} already contributed to this sum", node=str(node))
        if polys.shape != self.shape or polys.dtype != np.uint64:
            raise SecureAggregationError(f"ciphertexts of shape {polys.shape}, expected {self.shape}", node=str(node))
        if not reduced(polys, self.primes):
            raise SecureAggregationError("ciphertext residues are not reduced modulo their primes", node=str(node))
        add_mod_into(self.total, polys, self.primes)
        self.contributors.append(node)

    def manifest(self, *, key_id: str, round: int, group: int, subset: Sequence[int]) -> Manifest:
        return Manifest(key_id, round, group, tuple(sorted(self.contributors)), tuple(sorted(subset)), self.length,
                        c1_digest(self.c1))

    @property
    def c1(self) -> U64:
        return self.total[:, 1]

    @property
    def c0(self) -> U64:
        return self.total[:, 0]


def check_request(share: KeyShare, manifest: Manifest, c1: U64, asked: set[tuple[int, int]],
                  contributions: Sequence[Contribution], *, roster: Roster | None = None, binding: bytes = b"",
                  max_decryptions: int = MAX_DECRYPTIONS, min_contributors: int | None = None) -> None:
    """Every refusal rule; raises ``SecureAggregationError`` naming the rule.

    ``roster`` (a signed federation): every contribution must be signed by its department's
    registered key, for a distinct department. ``max_decryptions``: the key's cap.
    ``min_contributors``: the fewest contributors a decrypted sum may have (the run's signed
    ``secagg-min-group``, at least 2, e.g. for IFCA's per-cluster sums); None: t.
    """
    t = share.threshold
    if min_contributors is not None and min_contributors < 2:
        raise SecureAggregationError(f"refusing: a minimum of {min_contributors} contributor(s) would reveal "
                                     "single updates")
    fewest = t if min_contributors is None else min_contributors
    if manifest.key_id != share.key_id:
        raise SecureAggregationError(f"manifest is for key {manifest.key_id}, this node holds {share.key_id}")
    if len(set(manifest.contributors)) < fewest:
        limit = f"t={t}" if min_contributors is None else f"the run's minimum group of {fewest}"
        raise SecureAggregationError(f"refusing: {len(set(manifest.contributors))} contributor(s), fewer than {limit}")
    subset = set(manifest.subset)
    if len(subset) < t or len(subset) != len(manifest.subset):
        raise SecureAggregationError(f"refusing: decrypting subset of {len(subset)}, fewer than t={t}")
    if share.node not in subset:
        raise SecureAggregationError("refusing: this node is not in the decrypting subset")
    if not subset <= set(share.holders):
        raise SecureAggregationError("refusing: the decrypting subset names nodes that hold no share of this key")
    if (manifest.round, manifest.group) in asked:
        raise SecureAggregationError(
            f"refusing: round {manifest.round} group {manifest.group} was already decrypted by this node"
        )
    if len(asked) >= max_decryptions:
        raise SecureAggregationError(f"refusing: key {share.key_id} has answered {len(asked)} decryptions, its cap "
                                     f"of {max_decryptions}; a new key ceremony is needed")
    if c1.ndim != 3 or c1_digest(c1) != manifest.digest:
        raise SecureAggregationError("refusing: the ciphertext does not match the manifest's digest")
    if c1.shape[0] != share.params.chunks(manifest.length):
        raise SecureAggregationError("refusing: the ciphertext's size does not match the manifest's length")
    _check_contributions(share, manifest, c1, contributions, roster=roster, binding=binding)


def _check_contributions(share: KeyShare, manifest: Manifest, c1: U64, contributions: Sequence[Contribution], *,
                         roster: Roster | None, binding: bytes) -> None:
    nodes = [c.node for c in contributions]
    if len(set(nodes)) != len(nodes) or set(nodes) != set(manifest.contributors):
        raise SecureAggregationError("refusing: the contributors' tags do not match the manifest's contributors")
    if not set(nodes) <= set(share.holders):
        raise SecureAggregationError("refusing: a contributor holds no share of this key, so its ciphertext cannot "
                                     "be tied to the sum")
    if roster is not None:
        for c in contributions:
            roster.check(c.department, contribution_message(
                binding=binding, key_id=share.key_id, round_number=manifest.round, group=manifest.group, node=c.node,
                department=c.department, sealed=c.sealed), c.signature, node=c.node)
        if len({c.department for c in contributions}) != len(contributions):
            raise SecureAggregationError("refusing: two contributions claim one department")
    primes = Seal.of(share.params).primes_at(c1.shape[1])
    if bool(np.any(c1 >= np.asarray(primes, dtype=np.uint64)[:, None])):
        raise SecureAggregationError("refusing: ciphertext residues are not reduced")
    prg, aead = _round_keys(share, manifest.round, manifest.group)
    total = [0] * len(primes)
    for c in contributions:
        try:
            tag = ChaCha20Poly1305(aead).decrypt(c.sealed[:_NONCE], c.sealed[_NONCE:],
                                                 _aad(share, manifest.round, manifest.group, c.node))
        except (InvalidTag, ValueError):
            raise SecureAggregationError(f"refusing: node {c.node}'s tag does not open under this key's MAC key "
                                         "(forged, or from another round)", node=str(c.node)) from None
        if len(tag) != 8 * len(primes):
            raise SecureAggregationError(f"refusing: node {c.node}'s tag is for another ciphertext level", node=str(c.node))
        for j, q in enumerate(primes):
            total[j] = (total[j] + int.from_bytes(tag[8 * j: 8 * j + 8], "big")) % int(q)
    expected = b"".join(v.to_bytes(8, "big") for v in total)
    actual = b"".join(v.to_bytes(8, "big") for v in _projection(prg, c1, primes))
    if not hmac.compare_digest(expected, actual):
        raise SecureAggregationError("refusing: the ciphertext to decrypt is not the sum of the contributors' own "
                                     "ciphertexts (crafted or altered c1)")


def partial_decrypt(share: KeyShare, manifest: Manifest, c1: U64, asked: set[tuple[int, int]],
                    contributions: Sequence[Contribution], *, roster: Roster | None = None, binding: bytes = b"",
                    max_decryptions: int = MAX_DECRYPTIONS, min_contributors: int | None = None) -> U64:
    """d_p = λ_p(S)·σ_p·c1 + NTT(flooding noise) after every refusal check.

    The caller must record ``(manifest.round, manifest.group)`` as asked *before* sending the result.
    """
    check_request(share, manifest, c1, asked, contributions, roster=roster, binding=binding,
                  max_decryptions=max_decryptions, min_contributors=min_contributors)
    return answer_checked(share, manifest, c1)


def answer_checked(share: KeyShare, manifest: Manifest, c1: U64) -> U64:
    """The partial decryption of a request that ``check_request`` already passed (a node checks,
    writes its ledger entry, then answers: the checks run once)."""
    seal = Seal.of(share.params)
    primes = seal.primes_at(c1.shape[1])
    product = _unflooded(share, manifest, c1)
    bits = share.params.flood_bits(len(manifest.contributors), len(share.holders))
    noise = seal.to_ntt(flooding_noise(bits, primes, c1.shape))
    return add_mod(product, noise, primes)


def _unflooded(share: KeyShare, manifest: Manifest, c1: U64) -> U64:
    """λ_p(S)·σ_p·c1 alone. Never sent: tests compare it with SEAL's own decryptor."""
    seal = Seal.of(share.params)
    primes = seal.primes_at(c1.shape[1])
    if bool(np.any(c1 >= np.asarray(primes, dtype=np.uint64)[:, None])):
        raise SecureAggregationError("refusing: ciphertext residues are not reduced")
    indices = [share.members.index(n) + 1 for n in manifest.subset]
    lambdas = [lagrange_at_zero(share.index, indices, q) for q in primes]
    scaled = mul_scalar(share.share[: len(primes)], lambdas, primes)  # λ_p·σ_p at the ciphertext's level
    return seal.multiply(c1, scaled)


class DecryptionSum:
    """c0 plus the partial decryptions of S as they arrive (one aggregate in memory), then decoded."""

    def __init__(self, params: CkksParams, c0: U64, manifest: Manifest) -> None:
        self.params = params
        self.manifest = manifest
        self.primes = Seal.of(params).primes_at(c0.shape[1])
        self.total = c0.copy()
        self.answered: set[int] = set()

    def add(self, node: int, d: U64) -> None:
        if node not in self.manifest.subset or node in self.answered:
            raise SecureAggregationError("a partial decryption from outside S, or a second one", node=str(node))
        if d.shape != self.total.shape or d.dtype != np.uint64 or not reduced(d, self.primes):
            raise SecureAggregationError("partial decryption is malformed", node=str(node))
        add_mod_into(self.total, d, self.primes)
        self.answered.add(node)

    def result(self) -> NDArray[np.float64]:
        """The decoded sum once every member of S answered; otherwise ``QuorumNotMetError`` and nothing."""
        missing = sorted(set(self.manifest.subset) - self.answered)
        if missing:
            raise QuorumNotMetError(
                f"{len(missing)} of the {len(self.manifest.subset)} decryptors did not answer ({missing}); "
                "the aggregate stays encrypted"
            )
        return Seal.of(self.params).decode(self.total, self.manifest.length)


def combine(params: CkksParams, c0: U64, partials: Mapping[int, U64], manifest: Manifest) -> NDArray[np.float64]:
    """Decode c0 + Σ d_p once every member of S answered; fewer raises ``QuorumNotMetError``."""
    total = DecryptionSum(params, c0, manifest)
    for node in manifest.subset:
        if node in partials:
            total.add(node, partials[node])
    return total.result()
