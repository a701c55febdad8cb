"""Threshold-CKKS parameter sets: checked against SEAL's 128-bit limits, the smudging bound and a precision target.

Only additions are ever done homomorphically (FedAvg needs no multiplication, relinearisation or
rotation), so the coefficient chain only has to hold the scaled sum plus the decryptors' flooding
noise. Decisions, each checked by ``check``:

- security: total coefficient bits ≤ SEAL's ``CoeffModulus.MaxBitCount(N, tc128)``;
- flooding (smudging): every partial decryption adds uniform noise in [−B, B) with
  log2 B = κ + log2 N + log2 β(n, h), β(n, h) = 2^7·n·h a bound on the aggregate's own noise for n
  contributors under a key of h holders (a fresh encryption's noise e_pk·u + e0 + s·e1 grows with
  the h summed key parts; about 2^8–2^9 measured for 10 encryptions under 10 holders, so β(10, 10)
  = 2^13.6 leaves a margin of 2^4 or more), so the published decryption hides that noise, and with
  it the key, up to statistical distance 2^−κ (Li–Micciancio IND-CPA-D);
- capacity: |Σ values|·Δ·√2 + t·B must stay below half the modulus the ciphertexts travel at (two
  real values share one complex slot, so a slot's modulus is up to √2 times the value bound);
- precision: 6σ of the decryption error, σ = (B/√3)·√t·√(N/2)/Δ, must be ≤ the precision target.

Ciphertexts are switched down to the fewest primes that still hold the capacity ("send level"), so a
longer chain costs nothing on the wire. What travels — each update's c0 and each partial
decryption — is then divided by the level's last prime and rounded ("wire level", one prime fewer,
half the bytes at two primes) wherever the scale left, Δ/q_L, keeps the rounding error of up to
1,000 rounded terms at 6σ below a tenth of the precision target. Capacity is kept (message and
noise shrink with the modulus), the flooding ratio too, and each rounded term is a function of what
it rounds, so the server learns nothing it could not compute from the unrounded values.

Each of the N/2 slots is a complex number and carries two real values (real and imaginary part),
so one ciphertext holds N values: the decryption error of each part has the same σ as a real-only
slot's, and the bytes per value halve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from quorumfl.aggregation.secagg.messages import finite_number, resolve_threshold, whole_number
from quorumfl.errors import ConfigError

__all__ = ["CkksParams", "MAX_COEFF_BITS", "ceremony_threshold"]

# SEAL CoeffModulus.MaxBitCount(N, sec_level_type.tc128): special prime included.
MAX_COEFF_BITS = {4096: 109, 8192: 218, 16384: 438, 32768: 881}
NOISE_BITS = 7  # log2 of the per-contributor, per-holder bound on the aggregate's own noise β(n, h) = 2^7·n·h
SIGMAS = 6.0  # the precision target is checked at 6 standard deviations
ROUNDED_TERMS = 1000  # the wire level's rounding budget covers this many rounded c0s and partial decryptions


@dataclass(frozen=True)
class CkksParams:
    """One CKKS parameter set. ``coeff_bits[-1]`` is SEAL's special (key-level only) prime."""

    poly_degree: int = 8192
    coeff_bits: tuple[int, ...] = (60, 60, 60)
    scale_bits: int = 100
    smudging_bits: int = 40
    precision: float = 1e-5

    def __post_init__(self) -> None:
        problems = []
        if self.poly_degree not in MAX_COEFF_BITS:
            problems.append(f"poly-degree {self.poly_degree} must be one of {sorted(MAX_COEFF_BITS)}")
        if len(self.coeff_bits) < 2 or not all(isinstance(b, int) and 20 <= b <= 60 for b in self.coeff_bits):
            problems.append(f"coeff-bits {self.coeff_bits} must be ≥ 2 prime sizes between 20 and 60 bits")
        elif self.poly_degree in MAX_COEFF_BITS and sum(self.coeff_bits) > MAX_COEFF_BITS[self.poly_degree]:
            problems.append(
                f"coeff-bits sum to {sum(self.coeff_bits)} bits, above the 128-bit-security limit "
                f"{MAX_COEFF_BITS[self.poly_degree]} for N={self.poly_degree}; use fewer primes or a larger N"
            )
        if not 20 <= self.scale_bits <= 120:
            problems.append(f"scale-bits {self.scale_bits} must be between 20 and 120")
        if self.smudging_bits < 40:
            problems.append(f"smudging-bits {self.smudging_bits} is below 40: decryptions would leak key material")
        if not (self.precision > 0 and math.isfinite(self.precision)):
            problems.append(f"precision {self.precision} must be a positive number")
        if problems:
            raise ConfigError(problems)

    @property
    def slots(self) -> int:
        """Complex slots per ciphertext (N/2)."""
        return self.poly_degree // 2

    @property
    def values_per_ciphertext(self) -> int:
        """Real values per ciphertext: two per complex slot."""
        return 2 * self.slots

    @property
    def data_bits(self) -> tuple[int, ...]:
        """Prime sizes of a fresh ciphertext (all but the special prime)."""
        return self.coeff_bits[:-1]

    def chunks(self, length: int) -> int:
        """Ciphertexts needed for a vector of ``length`` values."""
        return max(1, -(-length // self.values_per_ciphertext))

    def flood_bits(self, contributors: int, holders: int) -> int:
        """log2 of the flooding bound B for an aggregate of ``contributors`` fresh encryptions under a
        key whose public key sums ``holders`` members' parts."""
        beta = NOISE_BITS + math.log2(max(contributors, 1)) + math.log2(max(holders, 1))
        return math.ceil(self.smudging_bits + math.log2(self.poly_degree) + beta)

    def error_std(self, threshold: int, contributors: int) -> float:
        """Predicted std of one decrypted slot's error: (B/√3)·√t·√(N/2)/Δ (flooding dominates);
        ``contributors`` bounds the holders too (a key has at most as many holders as members)."""
        flood = 2.0 ** self.flood_bits(contributors, contributors)
        return flood / math.sqrt(3.0) * math.sqrt(threshold) * math.sqrt(self.poly_degree / 2) / 2.0**self.scale_bits

    def fitted(self, *, threshold: int, contributors: int) -> CkksParams:
        """This set with ``scale_bits`` raised, when needed, to the fewest bits that meet the precision
        target for a ``threshold``-of-``contributors`` key (up to the 120-bit limit; ``check`` still has
        the last word, on capacity too). The flooding noise grows with the ceremony's size, so a key of
        100 holders needs 2^102 where 30 need no more than the default 2^100; the scale is not a security
        parameter (the smudging bits are), so the server may fit it per ceremony."""
        flood = 2.0 ** self.flood_bits(contributors, contributors)
        spread = SIGMAS * flood / math.sqrt(3.0) * math.sqrt(max(threshold, 1)) * math.sqrt(self.poly_degree / 2)
        needed = math.ceil(math.log2(spread / self.precision))
        bits = min(120, max(self.scale_bits, needed))
        return self if bits == self.scale_bits else replace(self, scale_bits=bits)

    def needed_bits(self, threshold: int, contributors: int, value_bound: float) -> float:
        """Bits the modulus needs for a sum of ``contributors`` values within ±value_bound, plus flooding."""
        message = contributors * value_bound * math.sqrt(2.0) * 2.0**self.scale_bits  # |re + i·im| ≤ √2·bound
        noise = threshold * 2.0 ** self.flood_bits(contributors, contributors) * 2  # t floods plus the aggregate's own noise
        return math.log2(message + noise) + 2  # sign bit and a factor-2 margin

    def send_primes(self, threshold: int, contributors: int, value_bound: float) -> int:
        """How many data primes ciphertexts keep on the wire (the rest are switched away)."""
        needed = self.needed_bits(threshold, contributors, value_bound)
        total = 0
        for count, bits in enumerate(self.data_bits, start=1):
            total += bits - 1  # SEAL's primes are a little below 2^bits
            if total >= needed:
                return count
        raise ConfigError([
            f"{sum(self.data_bits)} data bits cannot hold {needed:.0f} bits (sum of {contributors} values "
            f"within ±{value_bound:g} at scale 2^{self.scale_bits} plus flooding 2^{self.flood_bits(contributors, contributors)}); "
            "add a prime, lower the scale or the clip"
        ])

    def wire_primes(self, primes: int) -> int:
        """Primes a level-``primes`` ciphertext or partial decryption travels at (module docstring):
        one fewer where Δ/q_L (q_L < 2^bits, so at least 2^(scale − bits)) keeps 6σ of the rounding
        error, √(terms/12)·√(N/2)/(Δ/q_L), at or below a tenth of the precision target."""
        if primes < 2 or primes > len(self.data_bits):
            return primes
        scale_left = 2.0 ** (self.scale_bits - self.coeff_bits[primes - 1])
        spread = SIGMAS * math.sqrt(ROUNDED_TERMS / 12.0) * math.sqrt(self.poly_degree / 2)
        return primes - 1 if spread / scale_left <= self.precision / 10 else primes

    def check(self, *, threshold: int, contributors: int, value_bound: float) -> None:
        """Raise ``ConfigError`` listing every way this set fails for ``threshold``-of-``contributors``."""
        problems = []
        if not 1 <= threshold <= contributors:
            problems.append(f"threshold {threshold} must be between 1 and the {contributors} contributors")
        if not (value_bound > 0 and math.isfinite(value_bound)):
            problems.append(f"value bound {value_bound} must be a positive number")
        if problems:
            raise ConfigError(problems)
        try:
            self.send_primes(threshold, contributors, value_bound)
        except ConfigError as exc:
            problems.extend(exc.problems)
        predicted = SIGMAS * self.error_std(threshold, contributors)
        if predicted > self.precision:
            problems.append(
                f"predicted error {predicted:.2g} (6σ) exceeds the precision target {self.precision:g}; "
                f"raise scale-bits (now {self.scale_bits})"
            )
        if problems:
            raise ConfigError(problems)

    def to_dict(self) -> dict[str, object]:
        return {
            "poly_degree": self.poly_degree,
            "coeff_bits": list(self.coeff_bits),
            "scale_bits": self.scale_bits,
            "smudging_bits": self.smudging_bits,
            "precision": self.precision,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> CkksParams:
        try:
            bits = data["coeff_bits"]
            if not isinstance(bits, list):
                raise TypeError("coeff_bits must be a list")
            return cls(
                poly_degree=whole_number(data["poly_degree"], "poly_degree"),
                coeff_bits=tuple(whole_number(b, "coeff_bits") for b in bits),
                scale_bits=whole_number(data["scale_bits"], "scale_bits"),
                smudging_bits=whole_number(data["smudging_bits"], "smudging_bits"),
                precision=finite_number(data["precision"], "precision"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError([f"CKKS parameters are malformed ({exc})"]) from exc


def ceremony_threshold(threshold: float, members: int, *, roster: int = 0, floor: int = 0) -> int:
    """t for a key ceremony of ``members``: the run's ``secagg-threshold`` over the members, and never
    below ``floor`` (``ckks-min-threshold``) or, without one, the threshold over the ``roster``'s
    departments: a ceremony of fewer members keeps the t of the whole federation, so leaving honest
    departments out of it does not let fewer colluders decrypt (0 roster: no roster, no floor)."""
    whole = floor or (resolve_threshold(threshold, roster) if roster else 0)
    return max(resolve_threshold(threshold, members), whole)
