"""Shamir t-of-n secret sharing of short byte strings over the prime field GF(2^521 − 1).

Written here because neither ``cryptography`` nor the standard library ships Shamir sharing, and
PyCryptodome's version works on 16-byte blocks only (a 32-byte key would need two independent
sharings). One field element holds a whole 32-byte secret, so one share is one 66-byte number.
Coefficients come from ``secrets`` (the OS CSPRNG). Share holders are numbered by x-coordinate ≥ 1.
Reconstruction uses the barycentric form of Lagrange interpolation: the weights of the first t shares
once (O(t²)), then the secret and each further share's consistency check in O(t) each, where the
plain formula took O(t²) per point (O(t³) per secret with a sparse graph's 175 holders at 1,000 nodes).
Holders are a cohort's member indices (x ≤ a few thousand), so every difference x_a − x_i is a small
integer: products of differences are taken as exact integers (cheap small-by-large multiplications)
and their inverses come from one table of 1/1 … 1/limit (public constants, one modular inversion,
cached), so checking one further share costs t modular multiplications and no inversion.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache, partial

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


def _batch_inverse(values: Sequence[int]) -> list[int]:
    """Inverses mod PRIME of non-zero ``values`` with one modular inversion (Montgomery's trick)."""
    prefix = [1]
    for v in values:
        prefix.append(prefix[-1] * v % PRIME)
    inverse = pow(prefix[-1], -1, PRIME)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = inverse * prefix[i] % PRIME
        inverse = inverse * values[i] % PRIME
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


class _SmallPoints:
    """The polynomial through points with small x-coordinates, evaluated with exact integer
    products and a table of inverses (equal to ``_evaluate`` with ``_weights``: tested)."""

    def __init__(self, xs: Sequence[int], ys: Sequence[int]) -> None:
        self.xs, self.ys = list(xs), list(ys)
        self.table = _inverse_table(1 << max(4, max(xs).bit_length()))
        denominators = [math.prod(xi - xj for xj in xs if xj != xi) % PRIME for xi in xs]
        self.yw = [y * w % PRIME for y, w in zip(ys, _batch_inverse(denominators), strict=True)]

    def _inverse(self, d: int) -> int:
        return self.table[d] if d > 0 else PRIME - self.table[-d]

    def at(self, a: int) -> int:
        """Value at ``a`` (0 or a small x-coordinate)."""
        differences = [a - x for x in self.xs]
        reach = max(abs(d) for d in differences)
        if reach >= len(self.table):
            self.table = _inverse_table(1 << reach.bit_length())
        if 0 in differences:
            return self.ys[differences.index(0)]
        total = sum(yw * self._inverse(d) for yw, d in zip(self.yw, differences, strict=True)) % PRIME
        return math.prod(differences) % PRIME * total % PRIME


def reconstruct_secret(shares: Mapping[int, int], *, threshold: int, length: int) -> bytes:
    """The secret of ``length`` bytes from at least ``threshold`` shares.

    Shares beyond the threshold are checked against the polynomial the first ``threshold`` define,
    so a corrupted share is an error instead of a silently wrong secret.
    """
    if len(shares) < threshold:
        raise SecureAggregationError(f"{len(shares)} share(s) cannot reconstruct a {threshold}-of-n secret")
    points = sorted(shares.items())
    if any(not 0 <= y < PRIME for _, y in points) or any(not 1 <= x < PRIME for x, _ in points):
        raise SecureAggregationError("a share is not a field element")
    xs, ys = [x for x, _ in points[:threshold]], [y for _, y in points[:threshold]]
    evaluate: Callable[[int], int]
    if points[-1][0] <= SMALL_X:  # a cohort's member indices: the small-integer path
        evaluate = _SmallPoints(xs, ys).at
    else:
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
