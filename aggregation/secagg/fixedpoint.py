"""Fixed-point encoding of real vectors into Z_M (M = 2^32 or 2^64) so that masked sums do not wrap.

Each coordinate is clipped to [−clip, clip], multiplied by ``scale`` and stochastically rounded
(unbiased: E[encode(v)] = v·scale). The scale is the largest that keeps a sum of ``max_summands``
encoded values inside (−M/2, M/2):

    max_summands · (clip · scale + 1) ≤ M/2 − 1   ⇒   scale = ⌊(M/2 − 1 − max_summands) / (max_summands · clip)⌋

so the signed sum decodes exactly (the scale is also capped so that scaled values stay below 2^52,
where float64 is exact). Per coordinate, with n = max_summands and u = 2⁻⁵³ (float64's unit
roundoff), ``error_bound`` adds up:

- each stochastic rounding: less than 1/scale;
- each float64 product v·scale: at most |v·scale|·u, i.e. clip·u in value units (near the 2⁵² cap
  that is up to half a unit of the scaled grid, as large as the rounding itself);
- decoding: the integer sum converted to float64 (inexact above 2⁵³) and divided by scale, two
  roundings of at most |decoded sum|·u ≤ (n·clip + n/scale)·u each.

That is n/scale·(1 + 2u) + 3·n·clip·u to first order; ``error_bound`` rounds both factors up to 4
for the second-order terms: |decode(Σ encode(v_i)) − Σ clip(v_i)| ≤ n/scale·(1 + 4u) + 4·n·clip·u,
against the exact rational sum of the float64 inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import ConfigError

__all__ = ["FixedPoint", "ModulusBits"]

ModulusBits = int  # 32 or 64
_DTYPES: dict[int, np.dtype[np.unsignedinteger]] = {32: np.dtype("<u4"), 64: np.dtype("<u8")}


MIN_CLIP = 1e-9  # below it the scale overflows a float (a subnormal clip makes it infinite)


@dataclass(frozen=True)
class FixedPoint:
    modulus_bits: int
    clip: float
    max_summands: int

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.modulus_bits not in _DTYPES:
            problems.append(f"modulus bits must be 32 or 64, got {self.modulus_bits}")
        if not (math.isfinite(self.clip) and self.clip >= MIN_CLIP):
            problems.append(f"clip must be a number of at least {MIN_CLIP:g}, got {self.clip}")
        if self.max_summands < 1:
            problems.append(f"max summands must be >= 1, got {self.max_summands}")
        if not problems and self.scale < 1:
            problems.append(
                f"{self.max_summands} summands clipped to ±{self.clip} do not fit a 2^{self.modulus_bits} "
                "modulus; use 64 modulus bits or a smaller clip"
            )
        if problems:
            raise ConfigError(problems)

    @property
    def dtype(self) -> np.dtype[np.unsignedinteger]:
        return _DTYPES[self.modulus_bits]

    @property
    def scale(self) -> float:
        half = 2 ** (self.modulus_bits - 1) - 1
        fits = math.floor((half - self.max_summands) / (self.max_summands * self.clip))
        # Scaled values stay below 2^52, where float64 still holds every integer exactly.
        return float(min(fits, math.floor(2**52 / self.clip)))

    @property
    def error_bound(self) -> float:
        """Per-coordinate bound on |decoded sum − exact sum of the clipped values| (module docstring)."""
        n, unit = self.max_summands, 2.0**-53
        return n / self.scale * (1 + 4 * unit) + 4 * n * self.clip * unit

    def encode(self, values: NDArray[np.floating], rng: np.random.Generator) -> tuple[NDArray[np.unsignedinteger], int]:
        """Encoded copy of ``values`` and how many coordinates had to be clipped.

        Each coordinate is floor(v·scale) plus one with probability frac(v·scale), drawn from ``rng``.
        Written with few full-size temporaries (in place where it can): a node masks its update in a
        freshly forked task, where every new page of a temporary is a page fault, and the plain form
        (clip, scale, floor, compare, two int64 casts, a modulo) took twice as long there."""
        v = np.asarray(values, dtype=np.float64)
        low_end, high_end = (float(v.min()), float(v.max())) if v.size else (0.0, 0.0)  # NaN propagates
        if not (math.isfinite(low_end) and math.isfinite(high_end)):
            raise ConfigError("a value to encode is NaN or infinite; the update must be finite")
        if low_end < -self.clip or high_end > self.clip:
            clipped = int(np.count_nonzero(v < -self.clip)) + int(np.count_nonzero(v > self.clip))
            scaled = np.clip(v, -self.clip, self.clip)
            scaled *= self.scale
        else:
            clipped = 0
            scaled = v * self.scale
        low = np.floor(scaled)
        scaled -= low  # the fractional part, in [0, 1)
        low += rng.random(v.shape) < scaled  # exact: |low| + 1 stays below 2^53
        q = low.astype(np.int64)
        if self.modulus_bits == 64:
            return q.view(np.uint64), clipped
        return q.astype(np.uint32), clipped  # a cast to an unsigned type keeps the value mod 2^32

    def decode(self, total: NDArray[np.unsignedinteger]) -> NDArray[np.float64]:
        """Real values of a sum of at most ``max_summands`` encodings (mod M)."""
        t = np.asarray(total)
        if t.dtype != self.dtype:
            raise ConfigError(f"a {self.modulus_bits}-bit sum must be {self.dtype}, got {t.dtype}")
        if self.modulus_bits == 64:
            signed = t.view(np.int64)
        else:
            signed = t.astype(np.int64)
            signed[signed >= 1 << 31] -= 1 << 32
        return signed.astype(np.float64) / self.scale
