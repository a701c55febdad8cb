"""Arithmetic modulo SEAL's RNS primes with numpy: uniform sampling, small-multiplier products,
Shamir sharing per prime and coordinate, Lagrange coefficients, flooding noise, and the exact
residues of the encoder's float64 integers (``residues_of_integers``).

Values are uint64 arrays shaped ``[prime, coefficient]`` (or with leading batch axes). numpy has
no 128-bit product, so ``mul_small`` reduces ``a·k mod q`` for ``k < 2^40`` with a float64
quotient estimate and one exact correction in wrapping 64-bit arithmetic; products with full-size
field elements (Lagrange coefficients) use Python integers, which only happens once per key
ceremony or decryption on one key-sized array. Randomness comes from ``random_bytes``: AES-256-CTR
under a fresh key from ``os.urandom`` (a CTR-DRBG, 3× the kernel's rate for the megabytes of noise
a round draws; never numpy's PCG64), with rejection sampling so residues are exactly uniform.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from numpy.typing import NDArray

from quorumfl.errors import SecureAggregationError

__all__ = [
    "add_mod",
    "add_mod_into",
    "flooding_noise",
    "lagrange_at_zero",
    "mul_scalar",
    "mul_small",
    "random_bytes",
    "reduced",
    "residues_of_integers",
    "shamir_shares",
    "small_noise",
    "sub_mod",
    "sub_mod_into",
    "uniform_below",
    "uniform_mod",
]

U64 = NDArray[np.uint64]
SMALL = 1 << 40


def _q(primes: Sequence[int], a: U64) -> U64:
    """The primes shaped to broadcast along the prime axis (second to last) of ``a``."""
    if a.ndim < 2 or a.shape[-2] != len(primes):
        raise ValueError(f"array of shape {a.shape} has no axis of {len(primes)} primes before the last")
    return np.asarray(primes, dtype=np.uint64).reshape(-1, 1)


def _fold(value: U64, modulus: U64 | np.uint64, spare: U64, out: U64 | None = None) -> None:
    """value − modulus where value ≥ modulus, else value, into ``out`` (``value`` itself by default),
    for uint64 values below 2^63 + modulus: the difference of a smaller value wraps around 2^64 and
    loses the minimum, so two vector passes and no boolean mask. ``spare``: a buffer of value's shape."""
    np.subtract(value, modulus, out=spare)
    np.minimum(value, spare, out=value if out is None else out)


_BLOCK_WORDS = 1 << 16  # 512 KiB of uint64 per step of add_mod_into: the block stays in cache


def random_bytes(count: int) -> bytes:
    """``count`` bytes of AES-256-CTR keystream under a fresh 256-bit key from ``os.urandom``."""
    encryptor = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(bytes(16))).encryptor()
    return encryptor.update(bytes(count)) + encryptor.finalize()


def uniform_below(q: int, count: int, draw: Callable[[int], bytes]) -> U64:
    """``count`` residues uniform in [0, q) by rejection from ``draw(n)``, n bytes of a stream: words
    masked to q's bit length, those ≥ q dropped (a 60-bit SEAL prime drops about one in 2^30)."""
    mask = np.uint64((1 << int(q).bit_length()) - 1)
    out = np.empty(count, dtype=np.uint64)
    have = 0
    while have < count:
        words = np.frombuffer(draw(8 * (count - have + 64)), dtype="<u8")
        head = out[have:]
        np.bitwise_and(words[: head.size], mask, out=head)
        if int(head.max()) < q:  # the usual case: no word among the first ones needed is rejected
            break
        words = words & mask
        keep = words[words < np.uint64(q)][: count - have]
        out[have: have + keep.size] = keep
        have += keep.size
    return out


def uniform_mod(primes: Sequence[int], shape: tuple[int, ...]) -> U64:
    """Uniform residues, ``shape[0] == len(primes)``; rejection sampling from ``random_bytes``."""
    if shape[0] != len(primes):
        raise ValueError(f"first axis {shape[0]} must match the {len(primes)} primes")
    need = int(np.prod(shape[1:]))
    return np.stack([uniform_below(q, need, random_bytes).reshape(shape[1:]) for q in primes])


def add_mod(a: U64, b: U64, primes: Sequence[int]) -> U64:
    """(a + b) mod q along the prime axis (inputs reduced, primes < 2^63, so no overflow)."""
    q = _q(primes, a)
    s = a + b
    return np.where(s >= q, s - q, s)


def add_mod_into(acc: U64, b: U64, primes: Sequence[int]) -> None:
    """acc ← (acc + b) mod q in place, for reduced inputs (no full-size temporaries: a running sum
    stays one array).

    s = acc + b < 2q; s − q wraps around 2^64 when s < q, so min(s, s − q) is s mod q: three
    vector passes with no boolean mask, done a cache-sized block of rows at a time.
    """
    q = _q(primes, acc)
    if b.shape != acc.shape:
        raise ValueError(f"cannot add an array of shape {b.shape} into one of shape {acc.shape}")
    if not acc.flags.c_contiguous:
        np.add(acc, b, out=acc)
        np.subtract(acc, q, out=acc, where=acc >= q)
        return
    rows_a = acc.reshape(-1, acc.shape[-2], acc.shape[-1])
    rows_b = np.ascontiguousarray(b).reshape(rows_a.shape)
    step = max(1, _BLOCK_WORDS // (acc.shape[-2] * acc.shape[-1]))
    scratch = np.empty((min(step, rows_a.shape[0]), *rows_a.shape[1:]), dtype=np.uint64)
    for start in range(0, rows_a.shape[0], step):
        a = rows_a[start: start + step]
        s = scratch[: a.shape[0]]
        np.add(a, rows_b[start: start + step], out=a)
        _fold(a, q, s)


def sub_mod_into(acc: U64, b: U64, primes: Sequence[int]) -> None:
    """acc ← (acc − b) mod q in place, for reduced inputs: ``add_mod_into`` of q − b ∈ (0, q] (the sum
    stays below 2q, all its min(s, s − q) needs)."""
    if b.shape != acc.shape:
        raise ValueError(f"cannot subtract an array of shape {b.shape} from one of shape {acc.shape}")
    add_mod_into(acc, np.subtract(_q(primes, acc), b), primes)


def reduced(a: U64, primes: Sequence[int]) -> bool:
    """Whether every residue of ``a`` (``[..., prime, coeff]``) is below its prime (one max per prime)."""
    q = _q(primes, a)
    rows = a.reshape(-1, a.shape[-2], a.shape[-1])
    return bool(np.all(rows.max(axis=2).max(axis=0) < q[:, 0]))


def sub_mod(a: U64, b: U64, primes: Sequence[int]) -> U64:
    q = _q(primes, a)
    return np.where(a >= b, a - b, a + (q - b))


def mul_small(a: U64, k: int, q: int) -> U64:
    """(a·k) mod q for residues ``a`` < q < 2^62 and 0 ≤ k < 2^40.

    The quotient ⌊a·k/q⌋ < 2^40 is estimated in float64 (error far below 1), the remainder is
    computed modulo 2^64 — exact because the true remainder of the estimate lies in (−q, 2q) —
    and corrected once.
    """
    if not 0 <= k < SMALL:
        raise ValueError(f"multiplier {k} is not below 2^40")
    quotient = np.floor(a.astype(np.float64) * (float(k) / float(q))).astype(np.uint64)
    with np.errstate(over="ignore"):
        r = (a * np.uint64(k) - quotient * np.uint64(q)).view(np.int64)
    r = np.where(r < 0, r + np.int64(q), r)
    r = np.where(r >= np.int64(q), r - np.int64(q), r)
    return r.astype(np.uint64)


def mul_scalar(a: U64, scalars: Sequence[int], primes: Sequence[int]) -> U64:
    """(a[j]·scalars[j]) mod primes[j] with full-size scalars (Python integers; key-sized arrays only)."""
    out = np.empty_like(a)
    for j, (c, q) in enumerate(zip(scalars, primes, strict=True)):
        prod = (a[j].astype(object) * (int(c) % int(q))) % int(q)
        out[j] = prod.astype(np.uint64)
    return out


def mul_mod(a: U64, b: U64, primes: Sequence[int]) -> U64:
    """Element-wise (a·b) mod q per prime with Python integers (key-level arrays only)."""
    out = np.empty_like(a)
    for j, q in enumerate(primes):
        out[j] = ((a[j].astype(object) * b[j].astype(object)) % int(q)).astype(np.uint64)
    return out


def shamir_shares(secret: U64, points: Sequence[int], threshold: int, primes: Sequence[int]) -> list[U64]:
    """Shares f(x) of every residue of ``secret`` ([prime, coeff]) for each x in ``points``.

    f has degree threshold − 1, constant term the secret and uniform other coefficients, one
    polynomial per prime and coordinate. Points are small distinct positive integers (party
    indices), so Horner's rule needs only ``mul_small``.
    """
    if threshold < 1 or len(set(points)) != len(points) or not all(0 < x < SMALL for x in points):
        raise SecureAggregationError(f"Shamir points {list(points)} must be distinct, positive and small")
    coeffs = [uniform_mod(primes, secret.shape) for _ in range(threshold - 1)]
    shares = []
    for x in points:
        acc = np.zeros_like(secret)
        for c in reversed(coeffs):
            acc = add_mod(np.stack([mul_small(acc[j], x, q) for j, q in enumerate(primes)]), c, primes)
        acc = add_mod(np.stack([mul_small(acc[j], x, q) for j, q in enumerate(primes)]), secret, primes)
        shares.append(acc)
    return shares


def lagrange_at_zero(party: int, subset: Sequence[int], q: int) -> int:
    """λ_party(subset) = Π_{j≠party} j / (j − party) mod q."""
    if party not in subset or len(set(subset)) != len(subset):
        raise SecureAggregationError(f"party {party} is not in the decrypting subset {list(subset)}")
    num, den = 1, 1
    for j in subset:
        if j != party:
            num = num * j % q
            den = den * (j - party) % q
    return num * pow(den, -1, q) % q


CBD_ETA = 21  # centred binomial: variance η/2 = 10.5, σ = 3.24 (SEAL's error has σ = 3.2)


def small_noise(primes: Sequence[int], shape: tuple[int, ...]) -> U64:
    """Encryption errors: one centred-binomial integer per coefficient (popcount of 21 random bits
    minus popcount of 21 more, so |e| ≤ 21), as residues ``[..., prime, coeff]`` shaped per ``shape``.

    A centred binomial of the same variance stands in for SEAL's clipped normal (as Kyber's and
    NewHope's RLWE errors do); the lattice attacks that set the 128-bit limits depend on σ, not
    on the distribution's shape. Bits come from ``random_bytes``.
    """
    if shape[-2] != len(primes):
        raise ValueError(f"axis -2 of {shape} must match the {len(primes)} primes")
    count = int(np.prod(shape)) // len(primes)
    words = np.frombuffer(random_bytes(8 * count), dtype=np.uint64)
    mask = np.uint64((1 << CBD_ETA) - 1)
    # both popcounts are at most 21, so their difference is exact in int8: one byte per coefficient
    # until each prime's residues are written
    value = np.bitwise_count(words & mask).view(np.int8)
    value -= np.bitwise_count((words >> np.uint64(32)) & mask).view(np.int8)
    value = value.reshape(*shape[:-2], shape[-1])
    out = np.empty(shape, dtype=np.uint64)
    wrapped = np.empty(value.shape, dtype=np.uint64)
    for j, q in enumerate(primes):
        residues = out[..., j, :]
        np.copyto(residues, value, casting="unsafe")  # e, or 2^64 + e when e < 0
        np.add(residues, np.uint64(q), out=wrapped)  # e + q, or q + e (wrapped) when e < 0
        np.minimum(residues, wrapped, out=residues)  # e mod q either way
    return out


def flooding_noise(bits: int, primes: Sequence[int], shape: tuple[int, ...]) -> U64:
    """Integers uniform in [−2^bits, 2^bits), as residues ``[..., prime, coeff]``-shaped per ``shape``.

    ``shape`` is (batch, len(primes), N). Each integer is h·2^32 + l with h uniform in
    [−2^(bits−32), 2^(bits−32)) and l uniform in [0, 2^32); supports 33 ≤ bits ≤ 94.
    """
    if not 33 <= bits <= 94:
        raise SecureAggregationError(f"flooding bound 2^{bits} is outside the supported 2^33..2^94")
    count = int(np.prod(shape)) // len(primes)
    high_bits = bits - 32
    raw = random_bytes(12 * count)
    hi_raw = np.frombuffer(raw, dtype=np.uint64, count=count) & np.uint64((1 << (high_bits + 1)) - 1)
    hi = hi_raw.view(np.int64) - np.int64(1 << high_bits)  # uniform in [−2^hb, 2^hb)
    lo = np.frombuffer(raw, dtype=np.uint32, offset=8 * count).astype(np.int64)
    batch, _, degree = shape
    out = np.empty(shape, dtype=np.uint64)
    estimate = np.empty(count, dtype=np.float64)
    quotient = np.empty(count, dtype=np.int64)
    value = np.empty(count, dtype=np.uint64)
    spare = np.empty(count, dtype=np.uint64)
    for j, q in enumerate(primes):
        # h·2^32 mod q from the quotient's float64 estimate, off by at most one while it stays below 2^50
        # (h itself when bits − log2 q allows, else h mod q first), so the remainder computed modulo
        # 2^64 lies in (−q, 2q); l (reduced when q is small) adds less than q, and q more makes it
        # (0, 4q): below 2^63, so two uint64 minimums (r − 2q, then r − q, wrap when r is smaller)
        # bring it into [0, q)
        h = hi if bits - (int(q).bit_length() - 1) <= 50 else np.mod(hi, np.int64(q))
        np.multiply(h, 2.0**32 / float(q), out=estimate)
        np.floor(estimate, out=estimate)
        np.copyto(quotient, estimate, casting="unsafe")
        modulus = np.uint64(q)
        with np.errstate(over="ignore"):  # wraps modulo 2^64 to the true remainder
            np.left_shift(h.view(np.uint64), np.uint64(32), out=value)
            np.multiply(quotient.view(np.uint64), modulus, out=spare)
            value -= spare
            value += lo.view(np.uint64) if q > 1 << 32 else (lo % np.int64(q)).view(np.uint64)
            value += modulus
            _fold(value, np.uint64(2 * q), spare)
            _fold(value, modulus, spare)
        out[:, j, :] = value.reshape(batch, degree)
    return out


_ESTIMATE_BIAS = 2.0**-4  # subtracted from a quotient estimate (whose error is below 2^-6.5) so it never exceeds the quotient


def residues_of_integers(values: NDArray[np.float64], primes: Sequence[int], out: U64) -> None:
    """Exact residues of integer-valued float64 ``values`` (any shape, |v| < 2^104) modulo each prime
    (2^19 < q < 2^61), into ``out`` shaped ``values.shape[:-1] + (len(primes), values.shape[-1])``.

    v = s·(h·2^63 + l) with s = ±1, h < 2^41 and l < 2^63, where s·h and s·l are exact in float64
    (|v| and h·2^63 are multiples of |v|'s last bit, so their difference is too) and s·l fits an
    int64. For each prime q, T = s·h·(2^63 mod q) + s·l ≡ v (mod q) and |T/q| < 2^41 + 2^63/q < 2^44.2;
    both terms share a sign, so float64 estimates T/q to within 5·2^−53 relative, under 2^−6.5.
    Lowered by 2^−4 and floored, that is ⌊T/q⌋ or one less, so T − Q·q lies in [0, 2q): computed
    modulo 2^64 in int64 arithmetic it is exact, and min(r, r − q) over uint64 (r − q wraps when
    r < q) brings it into [0, q). Vector passes only: no integer division, no boolean mask.
    """
    if len(primes) != out.shape[-2] or out.shape[:-2] != values.shape[:-1] or out.shape[-1] != values.shape[-1]:
        raise ValueError(f"out of shape {out.shape} does not fit values {values.shape} and {len(primes)} primes")
    if any(not 1 << 19 < q < 1 << 61 for q in primes):
        raise ValueError("residues_of_integers takes primes between 2^19 and 2^61")
    high = np.abs(values)
    high *= 2.0**-63
    np.floor(high, out=high)
    if high.size and float(high.max()) >= 2.0**41:
        raise SecureAggregationError("values too large to encode at this scale: a coefficient passes 2^104")
    np.copysign(high, values, out=high)  # s·h
    low = high * -(2.0**63)
    low += values  # s·l, exact
    high_words = high.astype(np.int64)
    low_words = low.astype(np.int64)
    estimate = np.empty_like(high)
    quotient = np.empty(values.shape, dtype=np.int64)
    value = np.empty(values.shape, dtype=np.int64)
    for j, q in enumerate(primes):
        wrap = pow(2, 63, q)
        np.multiply(high, float(wrap), out=estimate)
        estimate += low
        estimate *= 1.0 / float(q)
        estimate -= _ESTIMATE_BIAS
        np.floor(estimate, out=estimate)
        np.copyto(quotient, estimate, casting="unsafe")
        np.multiply(high_words, np.int64(wrap), out=value)  # int64 products and sums wrap modulo 2^64,
        value += low_words                                   # and the true T − Q·q is in [0, 2q)
        quotient *= np.int64(q)
        value -= quotient
        _fold(value.view(np.uint64), np.uint64(q), quotient.view(np.uint64), out=out[..., j, :])


