"""Shamir t-of-n secret sharing of short byte strings over the prime field GF(2^521 − 1).

Written here because neither ``cryptography`` nor the standard library ships Shamir sharing, and
PyCryptodome's version works on 16-byte blocks only (a 32-byte key would need two independent
sharings). One field element holds a whole 32-byte secret, so one share is one 66-byte number.
Coefficients come from ``secrets`` (the OS CSPRNG). Share holders are numbered by x-coordinate ≥ 1.
Reconstruction uses the barycentric form of Lagrange interpolation: the weights of the first t shares
once (O(t²)), then the secret and each further share's consistency check in O(t) each, where the
plain formula took O(t²) per point (O(t³) per secret with a sparse graph's 175 holders at 1,000 nodes).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence

from quorumfl.errors import SecureAggregationError

__all__ = [
    "PRIME", "SHARE_BYTES", "interpolate_at", "reconstruct_secret", "share_from_bytes", "share_to_bytes", "split_secret",
]

PRIME = 2**521 - 1  # a Mersenne prime: any secret of up to 65 bytes is a field element
SHARE_BYTES = 66  # big-endian encoding of one field element


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
    weights = _weights(xs)  # once per secret: each check and the secret itself then cost O(t)
    for x, y in points[threshold:]:
        if _evaluate(xs, ys, weights, x) != y:
            raise SecureAggregationError(f"share of holder {x} is inconsistent with the others")
    value = _evaluate(xs, ys, weights, 0)
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
