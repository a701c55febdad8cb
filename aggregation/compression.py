"""Update compression: top-k, scaled sign (1 bit), 8-bit stochastic quantisation, shared random-k.

Pure numpy, used by both sides: a node encodes its update (with error feedback, ``ErrorFeedback``),
the server decodes. Each named array is encoded on its own (per-tensor k, scale), so every layer
moves each round. What travels:

- ``topk``: the k = ⌈fraction·d⌉ largest-magnitude entries as float16 values and their positions as
  gaps (``gap``: how many entries were skipped since the previous kept one), in uint8 or uint16
  words, whichever is smaller for the update; the largest word (0xFF or 0xFFFF) means "skip that many
  more" without an entry. At 1 % a position takes about 1.08 bytes (uint8; a gap of 255 or more
  needs an extra word), so about 3.1 bytes per kept entry: ~125× smaller than float32.
- ``sign``: one bit per entry (``np.packbits``) and one float32 scale, mean |x| (Karimireddy et al.,
  2019, EF-SignSGD); ``||x − s·sign(x)||² = ||x||² − ||x||₁²/d``.
- ``int8``: ``round_stochastic(x / s)`` with s = max|x| / 127, one byte per entry, unbiased, error < s.
- ``randk``: the values at k coordinates that a per-round seed chooses, the same on every node, so
  the sum of encodings is the encoding of the sum (secure aggregation still works); the indices are
  not sent. Values travel as float16 in plaintext mode.

Error feedback (Seide et al., 2014; Stich et al., 2018): the node adds what earlier rounds did not
send (the residual) to its update before encoding, and keeps ``corrected − decode(encoded)`` as the
new residual, so nothing is lost, only delayed. No library implements this for federated updates
(torch's ``ddp_comm_hooks`` do it for gradients inside one DDP job), hence this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import AggregationError, ConfigError

__all__ = [
    "Encoded", "ErrorFeedback", "Scheme", "decode", "decode_arrays", "encode", "encode_arrays", "gap_words", "gaps_to_positions",
    "payload_bytes", "positions_to_gaps", "shared_indices", "shared_positions", "warmup_fraction",
]

F32 = NDArray[np.float32]
Arrays = dict[str, NDArray[np.generic]]


class Scheme(StrEnum):
    NONE = "none"
    TOPK = "topk"
    SIGN = "sign"
    INT8 = "int8"
    RANDK = "randk"


@dataclass(frozen=True)
class Encoded:
    """One array's encoding: ``parts`` is exactly what travels."""

    scheme: Scheme
    shape: tuple[int, ...]
    parts: dict[str, NDArray[np.generic]]

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts.values())


def _k(size: int, fraction: float) -> int:
    return max(1, min(size, math.ceil(fraction * size)))


_WORDS = (np.dtype(np.uint8), np.dtype(np.uint16))


def _skipped(positions: NDArray[np.integer]) -> NDArray[np.int64]:
    pos = np.asarray(positions, np.int64)
    gaps = pos.copy()  # entries skipped before each kept one
    gaps[1:] = pos[1:] - pos[:-1] - 1
    if gaps.size and gaps.min() < 0:
        raise AggregationError("top-k positions must be sorted and distinct")
    return gaps


def gap_words(positions: Sequence[NDArray[np.integer]]) -> np.dtype[np.unsignedinteger]:
    """The gap word (uint8 or uint16) that spells all these arrays' positions in fewer bytes."""
    gaps = [_skipped(p) for p in positions]
    def cost(word: np.dtype[np.unsignedinteger]) -> int:
        skip = int(np.iinfo(word).max)
        return word.itemsize * sum(int(g.size) + int((g // skip).sum()) for g in gaps)
    return min(_WORDS, key=cost)


def positions_to_gaps(positions: NDArray[np.integer], word: np.dtype[np.unsignedinteger] | type = np.uint16
                      ) -> NDArray[np.unsignedinteger]:
    """Sorted, distinct positions as gaps in ``word``s: each kept entry is preceded by the number of
    entries skipped since the previous one; a gap of ``max(word)`` or more is spelt with that many
    skip words (the word's largest value) first."""
    word = np.dtype(word)
    if word not in _WORDS:
        raise ConfigError(f"top-k gap words must be uint8 or uint16, got {word}")
    skip = int(np.iinfo(word).max)
    gaps = _skipped(positions)
    skips, rest = np.divmod(gaps, skip)
    out = np.full(int(skips.sum()) + gaps.size, skip, word)
    out[np.cumsum(skips + 1) - 1] = rest
    return out


def gaps_to_positions(gaps: NDArray[np.generic]) -> NDArray[np.int64]:
    """The positions ``positions_to_gaps`` spelt (the word is the array's dtype, uint8 or uint16)."""
    if np.dtype(gaps.dtype) not in _WORDS:
        raise AggregationError(f"top-k gaps must be uint8 or uint16 words, got {gaps.dtype}")
    skip = 0xFF if np.dtype(gaps.dtype) == np.uint8 else 0xFFFF
    words = np.asarray(gaps).astype(np.int64)
    is_skip = words == skip
    ends = np.cumsum(np.where(is_skip, skip, words + 1))
    return np.asarray(ends[~is_skip] - 1, np.int64)


def warmup_fraction(fraction: float, round_number: int, warmup_rounds: int) -> float:
    """The share of entries a round keeps when compression warms up (Lin et al., "Deep Gradient
    Compression", ICLR 2018): 25 % in round 1, a quarter of that each next round, never below
    ``fraction``, and ``fraction`` after ``warmup_rounds`` rounds. Early updates are large and change
    fast; sending them sparsely leaves most of them in the residuals for many rounds."""
    if round_number <= warmup_rounds:
        return max(fraction, min(1.0, 0.25 * 4.0 ** -(round_number - 1)))
    return fraction


def shared_indices(size: int, fraction: float, seed: int) -> NDArray[np.int64]:
    """The coordinates every node keeps in shared random-k mode: the same for the same seed."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(size, size=_k(size, fraction), replace=False)).astype(np.int64)


def encode(x: NDArray[np.floating], scheme: Scheme, *, fraction: float = 0.01, seed: int = 0,
           rng: np.random.Generator | None = None) -> Encoded:
    """Encode one array. ``seed`` picks randk's coordinates; ``rng`` draws int8's stochastic rounding."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    shape = tuple(np.shape(x))
    if not np.all(np.isfinite(flat)):
        raise AggregationError("update has NaN or infinite entries; it cannot be encoded")
    if scheme is Scheme.NONE:
        return Encoded(scheme, shape, {"val": flat.copy()})
    if scheme is Scheme.TOPK:
        k = _k(flat.size, fraction)
        idx = np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:] if k < flat.size else np.arange(flat.size)
        idx = np.sort(idx)
        return Encoded(scheme, shape, {"gap": positions_to_gaps(idx, gap_words([idx])),
                                       "val": flat[idx].astype(np.float16)})
    if scheme is Scheme.SIGN:
        scale = np.float32(np.abs(flat).mean()) if flat.size else np.float32(0)
        return Encoded(scheme, shape, {"bits": np.packbits(flat >= 0), "scale": np.array([scale], np.float32)})
    if scheme is Scheme.INT8:
        peak = float(np.abs(flat).max()) if flat.size else 0.0
        scale = np.float32(peak / 127.0)
        if scale == 0:
            return Encoded(scheme, shape, {"q": np.zeros(flat.size, np.int8), "scale": np.array([0.0], np.float32)})
        gen = rng or np.random.default_rng()
        scaled = flat / scale
        q = np.floor(scaled + gen.random(flat.size, dtype=np.float32))
        return Encoded(scheme, shape, {"q": np.clip(q, -127, 127).astype(np.int8),
                                       "scale": np.array([scale], np.float32)})
    if scheme is Scheme.RANDK:
        idx = shared_indices(flat.size, fraction, seed)
        return Encoded(scheme, shape, {"val": flat[idx].astype(np.float16)})
    raise ConfigError(f"compression must be one of {[s.value for s in Scheme]}, got {scheme!r}")


def decode(enc: Encoded, *, fraction: float = 0.01, seed: int = 0) -> F32:
    """The array an encoding stands for (randk needs the same ``fraction`` and ``seed``)."""
    size = math.prod(enc.shape)
    out = np.zeros(size, np.float32)
    p = enc.parts
    try:
        if enc.scheme is Scheme.NONE:
            out[:] = p["val"]
        elif enc.scheme is Scheme.TOPK:
            idx = gaps_to_positions(p["gap"])
            if idx.size != p["val"].size or (idx.size and idx.max() >= size):
                raise AggregationError(f"top-k indices do not fit an array of {size} entries")
            out[idx] = p["val"].astype(np.float32)
        elif enc.scheme is Scheme.SIGN:
            bits = np.unpackbits(p["bits"].astype(np.uint8), count=size).astype(np.float32)
            out[:] = (2 * bits - 1) * np.float32(p["scale"][0])
        elif enc.scheme is Scheme.INT8:
            out[:] = p["q"].astype(np.float32) * np.float32(p["scale"][0])
        elif enc.scheme is Scheme.RANDK:
            out[shared_indices(size, fraction, seed)] = p["val"].astype(np.float32)
    except (KeyError, ValueError, IndexError) as exc:
        raise AggregationError(f"a {enc.scheme} encoding of shape {enc.shape} is malformed ({exc})") from exc
    if not np.all(np.isfinite(out)):
        raise AggregationError(f"a {enc.scheme} encoding decodes to NaN or infinite values")
    return out.reshape(enc.shape)


def _seed(seed: int, name: str, names: list[str]) -> int:
    return seed * 1_000_003 + names.index(name)  # a different coordinate draw per array


def _global_topk(arrays: Mapping[str, NDArray[np.generic]], names: list[str], fraction: float) -> dict[str, Encoded]:
    flats = [np.asarray(arrays[n], np.float32).reshape(-1) for n in names]
    for flat in flats:
        if not np.all(np.isfinite(flat)):
            raise AggregationError("update has NaN or infinite entries; it cannot be encoded")
    whole = np.concatenate(flats)
    k = _k(whole.size, fraction)
    keep = np.sort(np.argpartition(np.abs(whole), whole.size - k)[whole.size - k:])
    positions, start = [], 0
    for flat in flats:
        lo, hi = np.searchsorted(keep, [start, start + flat.size])
        positions.append(keep[lo:hi] - start)
        start += flat.size
    word = gap_words(positions)  # one word for the whole update: the wire concatenates the arrays' gaps
    return {name: Encoded(Scheme.TOPK, tuple(np.shape(arrays[name])),
                          {"gap": positions_to_gaps(idx, word), "val": flat[idx].astype(np.float16)})
            for name, flat, idx in zip(names, flats, positions, strict=True)}


def encode_arrays(arrays: Mapping[str, NDArray[np.generic]], scheme: Scheme, *, fraction: float, seed: int,
                  rng: np.random.Generator | None = None) -> dict[str, Encoded]:
    """Encode a model's arrays. Top-k picks the k largest entries of the whole update (so the layers
    that moved most get the budget); the other schemes work array by array."""
    names = sorted(arrays)
    if scheme is Scheme.TOPK:
        return _global_topk(arrays, names, fraction)
    return {n: encode(np.asarray(arrays[n], np.float32), scheme, fraction=fraction, seed=_seed(seed, n, names), rng=rng)
            for n in names}


def decode_arrays(encoded: Mapping[str, Encoded], *, fraction: float, seed: int) -> dict[str, F32]:
    names = sorted(encoded)
    return {n: decode(encoded[n], fraction=fraction, seed=_seed(seed, n, names)) for n in names}


def shared_positions(shapes: Mapping[str, tuple[int, ...]], fraction: float, seed: int) -> NDArray[np.int64]:
    """Where the shared random-k coordinates of every array sit in the model's flat vector (arrays in
    sorted name order, as ``secagg.flatten`` lays them out); the same on every node and the server."""
    names = sorted(shapes)
    out, offset = [], 0
    for name in names:
        size = math.prod(shapes[name])
        out.append(offset + shared_indices(size, fraction, _seed(seed, name, names)))
        offset += size
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def payload_bytes(encoded: Mapping[str, Encoded]) -> int:
    return sum(e.nbytes for e in encoded.values())


@dataclass
class ErrorFeedback:
    """Encode ``update + residual``; the new residual is exactly what the encoding left out."""

    scheme: Scheme
    fraction: float = 0.01

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"compression-fraction must be in (0, 1], got {self.fraction}")

    def step(
        self, update: Mapping[str, NDArray[np.generic]], residual: Mapping[str, NDArray[np.generic]] | None, *,
        seed: int, rng: np.random.Generator | None = None, full: bool = False,
    ) -> tuple[dict[str, Encoded], dict[str, F32]]:
        """(encoding, new residual). ``full`` sends update + residual uncompressed and clears the residual
        (the periodic full-precision sync)."""
        if residual is not None and set(residual) != set(update):
            raise AggregationError("the stored residual does not match the model's arrays; remove it to start over")
        corrected = {k: np.asarray(update[k], np.float32) + (np.asarray(residual[k], np.float32) if residual else 0)
                     for k in update}
        scheme = Scheme.NONE if full else self.scheme
        encoded = encode_arrays(corrected, scheme, fraction=self.fraction, seed=seed, rng=rng)
        decoded = decode_arrays(encoded, fraction=self.fraction, seed=seed)
        return encoded, {k: (corrected[k] - decoded[k]).astype(np.float32) for k in corrected}
