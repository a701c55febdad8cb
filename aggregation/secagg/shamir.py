"""Shamir t-of-n secret sharing of short byte strings over the prime field GF(2^521 − 1).

Written here because neither ``cryptography`` nor the standard library ships Shamir sharing, and
PyCryptodome's version works on 16-byte blocks only (a 32-byte key would need two independent
sharings). One field element holds a whole 32-byte secret, so one share is one 66-byte number.
Coefficients come from ``secrets`` (the OS CSPRNG). Share holders are numbered by x-coordinate ≥ 1.
Reconstruction from shares with small x-coordinates (a cohort's member indices, x ≤ 2^14 — every
real call) checks all n shares at once and rebuilds the secret from the same quantities:

- vᵢ = 1/Π_{j≠i}(xᵢ − xⱼ). The differences are small integers, so numpy multiplies them in exact
  int64 chunks and Python only the chunks; one modular inversion serves all n (Montgomery's trick).
- Consistency (the dual code of Reed–Solomon): n points lie on one polynomial of degree < t iff
  Σᵢ vᵢ·g(xᵢ)·yᵢ = 0 for every g of degree < n − t. One g = (x − ρ)^(n−t−1) with ρ drawn from the
  OS CSPRNG (once per process and degree, never sent anywhere) tests them all: for shares off the
  polynomial the sum, as a polynomial in ρ, is non-zero of degree ≤ n − t − 1, so it vanishes for
  at most n − t − 1 of the 2^521 − 1 values of ρ (Schwartz–Zippel). A dealer who does not know ρ
  passes with probability below 2^−510.
- The secret: P(0) = (−1)^(n−1)·Πⱼxⱼ·Σᵢ vᵢ·yᵢ/xᵢ (1/xᵢ from a cached table of small inverses).

That is O(n) modular multiplications per secret where checking each share beyond the threshold
against the first t cost O(t) each, O(t²) in all (4–10 ms per secret at t = 88 of 175 holders, the
sparse graph at 1,000 departments; the unmask stage's largest cost). Reductions use the Mersenne
form of the prime (a mod 2^521 − 1 = (a & p) + (a >> 521)), several times cheaper than ``%``.
Large x-coordinates keep the barycentric form: weights of the first t shares once (O(t²)), then
the secret and each further share's check in O(t).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache, partial

import numpy as np

from quorumfl.errors import SecureAggregationError

__all__ = [
    "PRIME", "SHARE_BYTES", "interpolate_at", "reconstruct_secret", "share_from_bytes", "share_to_bytes", "split_secret",
]

PRIME = 2**521 - 1  # a Mersenne prime: any secret of up to 65 bytes is a field element
SHARE_BYTES = 66  # big-endian encoding of one field element
SMALL_X = 1 << 14  # x-coordinates up to this take the small-integer path (a table of 2^14 inverses at most)


def split_secret(secret: bytes, *, threshold: int, holders: Sequence[int]) -> dict[int, int]:
    """Shares of ``secret`` for each holder x-coordinate; any ``threshold`` of them reconstruct it."""
    if len(secret) > 65:
        raise SecureAggregationError(f"a shared secret is at most 65 bytes, got {len(secret)}")
    if len(set(holders)) != len(holders) or any(not 1 <= x < PRIME for x in holders):
        raise SecureAggregationError("share holders must be distinct x-coordinates >= 1")
    if not 1 <= threshold <= len(holders):
        raise SecureAggregationError(f"threshold must be in [1, {len(holders)}] holders, got {threshold}")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares: dict[int, int] = {}
    for x in holders:
        value = 0
        for c in reversed(coefficients):  # Horner
            value = (value * x + c) % PRIME
        shares[x] = value
    return shares


def _mod(value: int) -> int:
    """``value`` mod PRIME, by folding the Mersenne form (negative values take ``%``)."""
    if value < 0:
        return value % PRIME
    while value >> 521:
        value = (value & PRIME) + (value >> 521)
    return 0 if value == PRIME else value


def _batch_inverse(values: Sequence[int]) -> list[int]:
    """Inverses mod PRIME of non-zero ``values`` with one modular inversion (Montgomery's trick)."""
    prefix = [1]
    for v in values:
        prefix.append(_mod(prefix[-1] * v))
    inverse = pow(prefix[-1], -1, PRIME)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = _mod(inverse * prefix[i])
        inverse = _mod(inverse * values[i])
    return out


def _weights(xs: Sequence[int]) -> list[int]:
    """Barycentric weights 1 / Π_{j≠i} (x_i − x_j) of distinct x-coordinates (O(t²), once per point set)."""
    denominators = []
    for i, xi in enumerate(xs):
        d = 1
        for j, xj in enumerate(xs):
            if i != j:
                d = d * (xi - xj) % PRIME
        denominators.append(d)
    return _batch_inverse(denominators)


def _evaluate(xs: Sequence[int], ys: Sequence[int], weights: Sequence[int], at: int) -> int:
    """The polynomial through (xs, ys) at ``at``: L(at)·Σ wᵢyᵢ/(at − xᵢ), L(at) = Π (at − xⱼ) (O(t))."""
    differences = [(at - x) % PRIME for x in xs]
    if 0 in differences:
        return ys[differences.index(0)]
    inverses = _batch_inverse(differences)
    product = 1
    for d in differences:
        product = product * d % PRIME
    total = 0
    for y, w, inv in zip(ys, weights, inverses, strict=True):
        total = (total + y * w % PRIME * inv) % PRIME
    return product * total % PRIME


def _lagrange_at(points: Sequence[tuple[int, int]], at: int) -> int:
    """The value at ``at`` of the polynomial through ``points`` (degree len(points) − 1)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    return _evaluate(xs, ys, _weights(xs), at)


@lru_cache(maxsize=4)
def _inverse_table(limit: int) -> tuple[int, ...]:
    """1/d mod PRIME for d = 1 … limit at index d (index 0 unused)."""
    return (0, *_batch_inverse(range(1, limit + 1)))


def _difference_products(xs: Sequence[int]) -> list[int]:
    """|Π_{j≠i}(xᵢ − xⱼ)| mod PRIME for each i, for distinct small x-coordinates: numpy multiplies
    the differences in chunks whose products stay below 2^63, Python multiplies the chunks."""
    points = np.asarray(xs, dtype=np.int64)
    n = len(xs)
    per = 63 // max(1, int(points.max() - points.min()).bit_length())  # every |difference| < 2^bits
    width = -(-n // per) * per
    differences = np.ones((n, width), dtype=np.int64)
    np.subtract(points[:, None], points[None, :], out=differences[:, :n])
    np.abs(differences, out=differences)
    differences[np.arange(n), np.arange(n)] = 1
    product = differences[:, 0::per].copy()
    for k in range(1, per):
        product *= differences[:, k::per]
    chunks: list[list[int]] = product.tolist()
    return [_mod(math.prod(row)) for row in chunks]


@lru_cache(maxsize=256)
def _dual_table(degree: int, limit: int) -> tuple[int, ...]:
    """(x − ρ)^degree mod PRIME for x = 0 … limit, ρ secret and uniform (see the module docstring).

    The degree is the shares that arrived less t, so dropouts spread an unmask stage's secrets over
    a few dozen degrees: the cache holds 256 tables (≈ 100 KB each for a 1,000-member cohort) because
    rebuilding one (limit + 1 exponentiations, ~13 ms) per secret would cost more than the check saves."""
    rho = secrets.randbelow(PRIME)
    return tuple(pow(x - rho, degree, PRIME) for x in range(limit + 1))


def _small_reconstruct(xs: Sequence[int], ys: Sequence[int], threshold: int) -> int:
    """P(0) of the polynomial of degree < ``threshold`` through all (xs, ys), sorted small x;
    raises when the points do not lie on one such polynomial."""
    n = len(xs)
    limit = 1 << max(4, max(xs).bit_length())
    weighted = []
    for i, (y, w) in enumerate(zip(ys, _batch_inverse(_difference_products(xs)), strict=True)):
        a = _mod(y * w)  # yᵢ/|Dᵢ|; Dᵢ = Π_{j≠i}(xᵢ − xⱼ) has n − 1 − i negative factors (xs sorted)
        weighted.append(PRIME - a if a and (n - 1 - i) % 2 else a)
    if n > threshold:
        table = _dual_table(n - threshold - 1, limit)
        if _mod(sum(a * table[x] for x, a in zip(xs, weighted, strict=True))):
            raise SecureAggregationError(
                f"the {n} shares are inconsistent with one another (no polynomial of degree < {threshold} "
                "passes through them): a holder revealed, or the owner dealt, a wrong share")
    inverses = _inverse_table(limit)
    value = _mod(_mod(math.prod(xs)) * _mod(sum(a * inverses[x] for x, a in zip(xs, weighted, strict=True))))
    return PRIME - value if value and n % 2 == 0 else value


def reconstruct_secret(shares: Mapping[int, int], *, threshold: int, length: int) -> bytes:
    """The secret of ``length`` bytes from at least ``threshold`` shares.

    All shares must lie on one polynomial of degree < ``threshold`` (shares beyond the threshold are
    checked, not ignored), so a corrupted share is an error instead of a silently wrong secret.
    """
    if len(shares) < threshold:
        raise SecureAggregationError(f"{len(shares)} share(s) cannot reconstruct a {threshold}-of-n secret")
    points = sorted(shares.items())
    if any(not 0 <= y < PRIME for _, y in points) or any(not 1 <= x < PRIME for x, _ in points):
        raise SecureAggregationError("a share is not a field element")
    if points[-1][0] <= SMALL_X:  # a cohort's member indices: every share checked at once
        value = _small_reconstruct([x for x, _ in points], [y for _, y in points], threshold)
    else:
        xs, ys = [x for x, _ in points[:threshold]], [y for _, y in points[:threshold]]
        weights = _weights(xs)  # once per secret: each check and the secret itself then cost O(t)
        evaluate = partial(_evaluate, xs, ys, weights)
        for x, y in points[threshold:]:
            if evaluate(x) != y:
                raise SecureAggregationError(f"share of holder {x} is inconsistent with the others")
        value = evaluate(0)
    if value >= 1 << (8 * length):
        raise SecureAggregationError(f"the shares do not encode a {length}-byte secret")
    return value.to_bytes(length, "big")


def share_to_bytes(value: int) -> bytes:
    return value.to_bytes(SHARE_BYTES, "big")


def share_from_bytes(data: bytes) -> int:
    if len(data) != SHARE_BYTES:
        raise SecureAggregationError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    if value >= PRIME:
        raise SecureAggregationError("a share is not a field element")
    return value


def interpolate_at(points: Iterable[tuple[int, int]], at: int) -> int:
    """Value at ``at`` of the polynomial through ``points``; exposed for tests of the hiding property."""
    return _lagrange_at(list(points), at)
