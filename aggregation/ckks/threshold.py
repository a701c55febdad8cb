"""Threshold-CKKS rounds: encrypt an update, add ciphertexts, decrypt with t partial decryptions.

- A node encrypts its payload vector in chunks of N/2 slots under the joint public key, at the
  fewest primes that hold the sum (``CkksParams.send_primes``); it travels as ``[chunk, 2, prime, coeff]``.
- The server adds ciphertexts as they arrive (a running sum mod each prime: memory is one
  aggregate, not one per node), then fixes the decrypting subset S (|S| ≥ t) and sends each
  member of S the aggregate's c1 with a ``Manifest``.
- Member p answers d_p = λ_p(S)·σ_p·c1 + NTT(e_p), λ_p the Lagrange coefficient at 0 over S's
  indices, applied *before* the flooding noise e_p ∈ [−B, B) is added (multiplying noise by λ
  afterwards would blow it up to the size of q).
- The server combines m = c0 + Σ_{p∈S} d_p = Δ·Σx + small noise and decodes.

A member refuses (fails closed): a manifest for another key, fewer than t contributors, |S| < t,
itself not in S, S outside the key's holders, a c1 whose digest differs from the manifest's, and any
second request for the same (round, group) — decrypting one aggregate twice would let the server
average the flooding away, and decrypting two sums over different contributors of one round would
reveal their difference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..errors import QuorumNotMetError, SecureAggregationError
from .keys import KeyShare
from .params import CkksParams
from .rns import add_mod, add_mod_into, flooding_noise, lagrange_at_zero, mul_scalar
from .seal import Seal

__all__ = ["CiphertextSum", "DecryptionSum", "Manifest", "c1_digest", "combine", "encrypt_vector", "partial_decrypt"]

U64 = NDArray[np.uint64]


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
        self._q = np.asarray(self.primes, dtype=np.uint64)[:, None]

    def add(self, node: int, polys: U64) -> None:
        """Check and add one node's ciphertexts; a malformed one is refused whole (nothing added)."""
        if node in self.contributors:
            raise SecureAggregationError(f"node {node} already contributed to this sum", node=str(node))
        if polys.shape != self.shape or polys.dtype != np.uint64:
            raise SecureAggregationError(f"ciphertexts of shape {polys.shape}, expected {self.shape}", node=str(node))
        if bool(np.any(polys >= self._q)):
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


def check_request(share: KeyShare, manifest: Manifest, c1: U64, asked: set[tuple[int, int]]) -> None:
    """Every refusal rule; raises ``SecureAggregationError`` naming the rule."""
    t = share.threshold
    if manifest.key_id != share.key_id:
        raise SecureAggregationError(f"manifest is for key {manifest.key_id}, this node holds {share.key_id}")
    if len(set(manifest.contributors)) < t:
        raise SecureAggregationError(f"refusing: {len(set(manifest.contributors))} contributor(s), fewer than t={t}")
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
    if c1.ndim != 3 or c1_digest(c1) != manifest.digest:
        raise SecureAggregationError("refusing: the ciphertext does not match the manifest's digest")
    if c1.shape[0] != share.params.chunks(manifest.length):
        raise SecureAggregationError("refusing: the ciphertext's size does not match the manifest's length")


def partial_decrypt(share: KeyShare, manifest: Manifest, c1: U64, asked: set[tuple[int, int]]) -> U64:
    """d_p = λ_p(S)·σ_p·c1 + NTT(flooding noise) after every refusal check.

    The caller must record ``(manifest.round, manifest.group)`` as asked *before* sending the result.
    """
    check_request(share, manifest, c1, asked)
    seal = Seal.of(share.params)
    primes = seal.primes_at(c1.shape[1])
    product = _unflooded(share, manifest, c1)
    bits = share.params.flood_bits(len(manifest.contributors))
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
        if d.shape != self.total.shape or bool(np.any(d >= np.asarray(self.primes, dtype=np.uint64)[:, None])):
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
