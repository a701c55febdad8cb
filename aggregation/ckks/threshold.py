"""Threshold-CKKS rounds: encrypt an update, add ciphertexts, decrypt with t partial decryptions.

Every round of one key, group and server nonce has a common c1: a polynomial a expanded with
AES-256-CTR under SHA-256(key, round, group, nonce), which every contributor and every decryptor computes
itself, so it never travels and the server cannot choose it.

- Member i encrypts its payload vector with its own ceremony secret s_i (whose Shamir shares every
  holder keeps, one per dealer): c0_i = Δ·x_i + e_i − a·s_i, e_i a fresh centred-binomial error
  (η = 21: σ = 3.24, SEAL's 3.2 or more), in chunks of N values (two per complex slot), at the
  fewest primes that hold the sum (``CkksParams.send_primes``), L; it is ``[chunk, prime, coeff]``
  and travels divided by q_L and rounded (``wire_form``: one prime fewer at the default parameters,
  ``CkksParams.wire_primes``), packed at 60 bits (``packing``). A member encrypts at most once under one nonce (its
  key store's ledger): two encryptions under one a would give away the difference of two updates.
- The server adds the c0_i as they arrive (a running sum mod each prime: one aggregate in memory),
  fixes the decrypting subset S (|S| ≥ t) and sends each member of S a ``Manifest`` (key, round,
  group, nonce, contributors C, S, length, level) with every contributor's signed contribution.
- Member p answers d_p = λ_p(S)·σ_p(C)·a + NTT(e_p): σ_p(C) = Σ_{i∈C} f_i(x_p), its shares of
  the contributors' secrets, λ_p the Lagrange coefficient at 0 over S's indices, applied *before*
  the flooding noise e_p ∈ [−B, B) is added (multiplying noise by λ afterwards would blow it up to
  the size of q). Σ_{p∈S} λ_p·σ_p(C) = Σ_{i∈C} s_i. d_p travels in wire form too.
- The server combines m = Σ c0_i + Σ_{p∈S} d_p = (Δ·Σx + Σe_i + Σe_p)/q_L + rounding and decodes
  at scale Δ/q_L.

This is a threshold version of the multiparty-RLWE "collective public-key generation" share
(Mouchet et al., PETS 2021) with the message added: each c0_i is an RLWE sample under s_i with a
uniform a from a random oracle, so it hides x_i; the sum is the decryption of (Σc0_i, a) under
s_C. Against the public-key encryption it replaces, the update is half the bytes (no c1), a
decryptor receives no ciphertext at all, and an active server has no c1 to craft: a decryptor only
ever multiplies its shares by an a it derived itself, under a (round, group) it answers once.

A member refuses (fails closed): a manifest for another key, fewer than t contributors (or than the
run's signed ``secagg-min-group``, at least 2, where the admin set one: IFCA sums each cluster on
its own), |S| < t, itself not in S, S or C outside the key's holders, a contribution whose
signature does not check against the roster or two contributions of one department, any second
request for the same (round, group) — decrypting one aggregate twice would let the server average
the flooding away, and decrypting two sums over different contributors of one round would reveal
their difference (t is a majority of the members, so two disjoint decrypting subsets cannot exist)
— and more decryptions under one key than the run's cap; and a contribution whose signature does
not cover the manifest's length and level. A manifest naming a member who sent nothing decrypts to
noise (the term a·s_X of a member X without a c0 is uniform-looking and carries the flooding). One
that leaves out some contributors, with the others' signed records, is not refused: the server holds
each c0, so it gets the exact sum of the subset it names — one sum per (round, group), of at least
t (or the signed minimum group) contributors, as a masking server can claim that nodes dropped.
t colluding members can decrypt anything; t − 1 learn nothing from their shares.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from numpy.typing import NDArray

from quorumfl.aggregation.ckks.keys import KeyShare
from quorumfl.aggregation.ckks.params import CkksParams
from quorumfl.aggregation.ckks.rns import (
    add_mod_into,
    flooding_noise,
    lagrange_at_zero,
    mul_scalar,
    reduced,
    small_noise,
    uniform_below,
)
from quorumfl.aggregation.ckks.seal import Seal
from quorumfl.aggregation.secagg.identity import Roster, field_bytes
from quorumfl.aggregation.secagg.messages import whole_number
from quorumfl.errors import QuorumNotMetError, SecureAggregationError

__all__ = [
    "MAX_DECRYPTIONS",
    "MAX_VALUES",
    "NONCE_BYTES",
    "CiphertextSum",
    "Contribution",
    "DecryptionSum",
    "Manifest",
    "c0_digest",
    "combine",
    "common_c1",
    "contribute",
    "encrypt_vector",
    "partial_decrypt",
    "wire_form",
]

U64 = NDArray[np.uint64]
MAX_DECRYPTIONS = 1000  # default cap on partial decryptions one key share answers (run key ckks-max-decryptions)
MAX_VALUES = 1 << 27  # the longest aggregate a member agrees to decrypt (134M values; a is 2 GiB at two primes)
NONCE_BYTES = 16
_CONTRIBUTION_CONTEXT = b"quorumfl-ckks-contribution-v3"


def common_c1(key_id: str, *, round_number: int, group: int, nonce: bytes, primes: Sequence[int], chunks: int,
              degree: int) -> U64:
    """The round's common c1 ``[chunk, prime, coeff]``: uniform residues (NTT form), by rejection, from
    AES-256-CTR keyed with SHA-256 over (key, round, group, nonce) — one stream per prime; every
    party derives the same polynomials (SHA-256 as the random oracle, AES-CTR as its expander:
    2.6× SHAKE-256's rate for the 18 MB a 1.1M-parameter round draws)."""
    if len(nonce) != NONCE_BYTES:
        raise SecureAggregationError(f"a round nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
    label = b"quorumfl/ckks/common-c1" + field_bytes(key_id.encode()) + round_number.to_bytes(8, "big", signed=True) \
        + group.to_bytes(4, "big", signed=True) + nonce
    key = hashlib.sha256(label).digest()
    out = np.empty((chunks, len(primes), degree), dtype=np.uint64)
    for j, q in enumerate(primes):
        keystream = Cipher(algorithms.AES(key), modes.CTR(j.to_bytes(16, "big"))).encryptor()

        def draw(n: int, ks: CipherContext = keystream) -> bytes:
            return ks.update(bytes(n))

        out[:, j, :] = uniform_below(q, chunks * degree, draw).reshape(chunks, degree)
    return out


def contribution_message(*, binding: bytes, key_id: str, round_number: int, group: int, nonce: bytes, length: int,
                         primes: int, node: int, department: str, digest: bytes) -> bytes:
    """The bytes a contributor signs for its encrypted update (length-prefixed fields): with the
    vector's ``length`` and ciphertext level ``primes``, so a manifest that states others (a
    decryptor would expand and multiply as many c1 chunks as the length says) fails the check."""
    parts = [_CONTRIBUTION_CONTEXT, binding, key_id.encode(), round_number.to_bytes(8, "big", signed=True),
             group.to_bytes(4, "big", signed=True), nonce, length.to_bytes(8, "big"), primes.to_bytes(2, "big"),
             node.to_bytes(8, "big"), department.encode(), digest]
    return b"".join(field_bytes(p) for p in parts)


def c0_digest(c0: U64) -> bytes:
    """SHA-256 of a ciphertext's residues (little-endian uint64): what a contribution's signature binds."""
    return hashlib.sha256(np.ascontiguousarray(c0, dtype="<u8").tobytes()).digest()


@dataclass(frozen=True)
class Contribution:
    """A contributor's signed statement that it encrypted ``digest`` for (key, round, group, nonce)."""

    node: int
    department: str
    digest: bytes  # SHA-256 of its c0
    signature: bytes  # b"" in an unsigned federation


def contribute(share: KeyShare, c0: U64, *, round_number: int, group: int, nonce: bytes, length: int, primes: int,
               signer: Callable[[bytes], bytes] | None = None, department: str = "", binding: bytes = b"") -> Contribution:
    """A member's signed contribution record for its own ``c0`` of ``length`` values at ``primes``
    primes in (round, group, nonce)."""
    digest = c0_digest(c0)
    signature = b"" if signer is None else signer(contribution_message(
        binding=binding, key_id=share.key_id, round_number=round_number, group=group, nonce=nonce, length=length,
        primes=primes, node=share.node, department=department, digest=digest))
    return Contribution(share.node, department, digest, signature)


def encrypt_vector(share: KeyShare, values: NDArray[np.float64], *, primes: int, round_number: int, group: int,
                   nonce: bytes, wire: bool = False) -> U64:
    """c0 = Δ·values + e − a·s_i at ``primes`` primes, ``[chunk, prime, coeff]`` (module docstring); with
    ``wire``, in the form it travels (``wire_form``, computed in the same pass)."""
    if not np.all(np.isfinite(values)):
        raise SecureAggregationError("the vector to encrypt has non-finite values")
    seal = Seal.of(share.params)
    if primes not in seal.levels:
        raise SecureAggregationError(f"no ciphertext level with {primes} primes")
    level = seal.primes_at(primes)
    plain = seal.encode_coefficients(np.asarray(values, dtype=np.float64), primes)
    add_mod_into(plain, small_noise(level, plain.shape), level)  # Δ·x + e in the coefficient domain
    a = common_c1(share.key_id, round_number=round_number, group=group, nonce=nonce, primes=level,
                  chunks=plain.shape[0], degree=share.params.poly_degree)
    return seal.ntt_with_product(plain, a, np.ascontiguousarray(share.secret[:primes]), subtract=True,
                                 rescale=wire and _rescaled_on_wire(share.params, primes))


def _rescaled_on_wire(params: CkksParams, primes: int) -> bool:
    return params.wire_primes(primes) < primes


def wire_form(params: CkksParams, polys: U64) -> U64:
    """Level-L polynomials ``[chunk, prime, coeff]`` as they travel: divided by q_L and rounded where
    ``params.wire_primes(L)`` says so (a function of the polynomials alone: it reveals nothing they
    do not), else as they are."""
    return Seal.of(params).rescale(polys) if _rescaled_on_wire(params, polys.shape[1]) else polys


def _wire_scale(params: CkksParams, level: int, wire: int) -> float:
    """Δ divided by the primes dropped between the computing level and the wire level."""
    scale = 2.0**params.scale_bits
    for q in Seal.of(params).primes[wire:level]:
        scale /= float(q)
    return scale


@dataclass(frozen=True)
class Manifest:
    """What a decryptor is asked to decrypt, fixed by the server before anyone answers."""

    key_id: str
    round: int
    group: int
    nonce: bytes
    contributors: tuple[int, ...]
    subset: tuple[int, ...]  # decryptors, by node id
    length: int  # values in the aggregate
    primes: int  # the aggregate's ciphertext level

    def to_dict(self) -> dict[str, object]:
        return {"key_id": self.key_id, "round": self.round, "group": self.group, "nonce": self.nonce.hex(),
                "contributors": list(self.contributors), "subset": list(self.subset), "length": self.length,
                "primes": self.primes}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Manifest:
        try:
            contributors = data["contributors"]
            subset = data["subset"]
            if not isinstance(contributors, list) or not isinstance(subset, list):
                raise TypeError("contributors and subset must be lists")
            return cls(
                key_id=str(data["key_id"]), round=whole_number(data["round"], "round"),
                group=whole_number(data["group"], "group", low=-(2**31), high=2**31 - 1),
                nonce=bytes.fromhex(str(data["nonce"])),
                contributors=tuple(whole_number(c, "contributors", low=0, high=2**64 - 1) for c in contributors),
                subset=tuple(whole_number(s, "subset", low=0, high=2**64 - 1) for s in subset),
                length=whole_number(data["length"], "length", low=0),
                primes=whole_number(data["primes"], "primes", low=1, high=64),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SecureAggregationError(f"decryption manifest is malformed ({exc})") from exc


class CiphertextSum:
    """Running homomorphic sum of one group's c0 in wire form (the server's only CKKS state)."""

    def __init__(self, params: CkksParams, *, length: int, primes: int) -> None:
        seal = Seal.of(params)
        self.params = params
        self.length = length
        self.level = primes  # where the nodes compute
        wire = params.wire_primes(primes)
        self.primes = seal.primes_at(wire)
        self.shape = (params.chunks(length), wire, params.poly_degree)
        self.total = np.zeros(self.shape, dtype=np.uint64)
        self.contributors: list[int] = []

    def add(self, node: int, c0: U64) -> None:
        """Check and add one node's ciphertexts; a malformed one is refused whole (nothing added)."""
        if node in self.contributors:
            raise SecureAggregationError(f"node {node} already contributed to this sum", node=str(node))
        if c0.shape != self.shape or c0.dtype != np.uint64:
            raise SecureAggregationError(f"ciphertexts of shape {c0.shape}, expected {self.shape}", node=str(node))
        if not reduced(c0, self.primes):
            raise SecureAggregationError("ciphertext residues are not reduced modulo their primes", node=str(node))
        add_mod_into(self.total, c0, self.primes)
        self.contributors.append(node)

    def manifest(self, *, key_id: str, round: int, group: int, nonce: bytes, subset: Sequence[int]) -> Manifest:
        return Manifest(key_id, round, group, nonce, tuple(sorted(self.contributors)), tuple(sorted(subset)),
                        self.length, self.level)

    @property
    def c0(self) -> U64:
        return self.total


def check_request(share: KeyShare, manifest: Manifest, asked: set[tuple[int, int]],
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
    if len(set(manifest.contributors)) < fewest or len(set(manifest.contributors)) != len(manifest.contributors):
        limit = f"t={t}" if min_contributors is None else f"the run's minimum group of {fewest}"
        raise SecureAggregationError(f"refusing: {len(set(manifest.contributors))} distinct contributor(s), fewer "
                                     f"than {limit} or listed twice")
    subset = set(manifest.subset)
    if len(subset) < t or len(subset) != len(manifest.subset):
        raise SecureAggregationError(f"refusing: decrypting subset of {len(subset)}, fewer than t={t}")
    if share.node not in subset:
        raise SecureAggregationError("refusing: this node is not in the decrypting subset")
    if not subset <= set(share.holders):
        raise SecureAggregationError("refusing: the decrypting subset names nodes that hold no share of this key")
    if not set(manifest.contributors) <= set(share.holders):
        raise SecureAggregationError("refusing: a contributor holds no share of this key")
    if (manifest.round, manifest.group) in asked:
        raise SecureAggregationError(
            f"refusing: round {manifest.round} group {manifest.group} was already decrypted by this node"
        )
    if len(asked) >= max_decryptions:
        raise SecureAggregationError(f"refusing: key {share.key_id} has answered {len(asked)} decryptions, its cap "
                                     f"of {max_decryptions}; a new key ceremony is needed")
    if manifest.primes not in Seal.of(share.params).levels or manifest.primes > len(share.params.data_bits):
        raise SecureAggregationError(f"refusing: no ciphertext level with {manifest.primes} primes")
    if not 0 < manifest.length <= MAX_VALUES:
        raise SecureAggregationError(f"refusing: an aggregate of {manifest.length} values (at most {MAX_VALUES})")
    if len(manifest.nonce) != NONCE_BYTES:
        raise SecureAggregationError("refusing: the manifest's round nonce is malformed")
    _check_contributions(share, manifest, contributions, roster=roster, binding=binding)


def _check_contributions(share: KeyShare, manifest: Manifest, contributions: Sequence[Contribution], *,
                         roster: Roster | None, binding: bytes) -> None:
    nodes = [c.node for c in contributions]
    if len(set(nodes)) != len(nodes) or set(nodes) != set(manifest.contributors):
        raise SecureAggregationError("refusing: the contributions do not match the manifest's contributors")
    if roster is not None:
        for c in contributions:
            roster.check(c.department, contribution_message(
                binding=binding, key_id=share.key_id, round_number=manifest.round, group=manifest.group,
                nonce=manifest.nonce, length=manifest.length, primes=manifest.primes, node=c.node,
                department=c.department, digest=c.digest), c.signature, node=c.node)
        if len({c.department for c in contributions}) != len(contributions):
            raise SecureAggregationError("refusing: two contributions claim one department")


def partial_decrypt(share: KeyShare, manifest: Manifest, asked: set[tuple[int, int]],
                    contributions: Sequence[Contribution], *, roster: Roster | None = None, binding: bytes = b"",
                    max_decryptions: int = MAX_DECRYPTIONS, min_contributors: int | None = None) -> U64:
    """d_p = λ_p(S)·σ_p(C)·a + NTT(flooding noise) after every refusal check.

    The caller must record ``(manifest.round, manifest.group)`` as asked *before* sending the result.
    """
    check_request(share, manifest, asked, contributions, roster=roster, binding=binding,
                  max_decryptions=max_decryptions, min_contributors=min_contributors)
    return answer_checked(share, manifest)


def answer_checked(share: KeyShare, manifest: Manifest) -> U64:
    """The partial decryption of a request that ``check_request`` already passed (a node checks,
    writes its ledger entry, then answers: the checks run once), in wire form."""
    return _flooded(share, manifest, wire=True)


def _flooded(share: KeyShare, manifest: Manifest, *, wire: bool = False) -> U64:
    """λ_p(S)·σ_p(C)·a + NTT(e_p) at the computing level or, with ``wire``, as it travels (``wire_form``,
    computed in the same pass)."""
    seal = Seal.of(share.params)
    scaled, a = _decryption_terms(share, manifest)
    bits = share.params.flood_bits(len(manifest.contributors), len(share.holders))
    noise = flooding_noise(bits, seal.primes_at(manifest.primes), a.shape)
    return seal.ntt_with_product(noise, a, scaled, subtract=False,
                                 rescale=wire and _rescaled_on_wire(share.params, manifest.primes))


def _unflooded(share: KeyShare, manifest: Manifest) -> U64:
    """λ_p(S)·σ_p(C)·a alone. Never sent: tests compare it with SEAL's own decryptor."""
    scaled, a = _decryption_terms(share, manifest)
    return Seal.of(share.params).multiply(a, scaled)


def _decryption_terms(share: KeyShare, manifest: Manifest) -> tuple[U64, U64]:
    """(λ_p(S)·σ_p(C), the round's common c1) at the aggregate's level."""
    seal = Seal.of(share.params)
    primes = seal.primes_at(manifest.primes)
    indices = [share.members.index(n) + 1 for n in manifest.subset]
    lambdas = [lagrange_at_zero(share.index, indices, q) for q in primes]
    sigma = share.shares_of(manifest.contributors, manifest.primes)
    scaled = mul_scalar(sigma, lambdas, primes)
    a = common_c1(share.key_id, round_number=manifest.round, group=manifest.group, nonce=manifest.nonce,
                  primes=primes, chunks=share.params.chunks(manifest.length), degree=share.params.poly_degree)
    return scaled, a


class DecryptionSum:
    """Σ c0 plus the partial decryptions of S as they arrive (one aggregate in memory), then decoded."""

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
        scale = _wire_scale(self.params, self.manifest.primes, self.total.shape[1])
        return Seal.of(self.params).decode(self.total, self.manifest.length, scale=scale)


def combine(params: CkksParams, c0: U64, partials: Mapping[int, U64], manifest: Manifest) -> NDArray[np.float64]:
    """Decode Σc0 + Σ d_p once every member of S answered; fewer raises ``QuorumNotMetError``."""
    total = DecryptionSum(params, c0, manifest)
    for node in manifest.subset:
        if node in partials:
            total.add(node, partials[node])
    return total.result()
