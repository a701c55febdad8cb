"""SEAL's serialized objects as numpy arrays, and back (parse/build of the stream bytes).

TenSEAL's bindings give SEAL objects no buffer access: element accessors cost ~16 ms per
ciphertext, and ``save``/``load`` take file paths. Parsing the whole stream with numpy is ~3 ms per
ciphertext, and building a stream lets the protocol hand SEAL a key or plaintext it assembled itself
(the joint public key, a combined decryption). Layout (SEAL 4.x, little endian):

- header ``<H B B B B H Q>``: magic 0xA15E, header size 16, version major, minor, compression mode
  (0 none, 2 zstd), reserved, total size including the header;
- Ciphertext (and PublicKey) body: parms_id 4×u64, is_ntt u8, size u64, N u64, L u64, scale f64,
  correction factor u64, then a DynArray stream (its own header, count u64, count×u64 ordered
  polynomial, prime, coefficient);
- Plaintext and SecretKey body: parms_id 4×u64, coeff count u64, scale f64, DynArray stream.

``save()`` always writes zstd; ``load()`` accepts uncompressed streams, which is what we build.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import zstandard
from numpy.typing import NDArray

from quorumfl.errors import SecureAggregationError

__all__ = ["CiphertextData", "PlaintextData", "build_ciphertext", "build_plaintext", "parse_ciphertext", "parse_plaintext"]

MAGIC = 0xA15E
HEADER = struct.Struct("<HBBBBHQ")
PARMS = struct.Struct("<4Q")
CT_META = struct.Struct("<BQQQdQ")  # is_ntt, size, N, L, scale, correction factor
PT_META = struct.Struct("<Qd")  # coeff count, scale
COUNT = struct.Struct("<Q")
NONE, ZSTD = 0, 2
MAX_BODY = 1 << 31  # refuse to decompress anything larger (2 GiB)

ParmsId = tuple[int, int, int, int]
U64 = NDArray[np.uint64]


@dataclass(frozen=True)
class CiphertextData:
    """A ciphertext (or public key) as ``polys[k, prime, coefficient]``."""

    parms_id: ParmsId
    is_ntt: bool
    scale: float
    polys: U64
    correction: int = 1


@dataclass(frozen=True)
class PlaintextData:
    """A plaintext (or secret key) in NTT form at a level, as ``coeffs[prime, coefficient]``."""

    parms_id: ParmsId
    scale: float
    coeffs: U64


def _body(raw: bytes, version: tuple[int, int]) -> bytes:
    if len(raw) < HEADER.size:
        raise SecureAggregationError(f"SEAL stream of {len(raw)} bytes is shorter than its header")
    magic, size, major, minor, mode, _, total = HEADER.unpack_from(raw)
    if magic != MAGIC or size != HEADER.size:
        raise SecureAggregationError("not a SEAL stream (bad magic or header size)")
    if (major, minor) != version and version != (0, 0):
        raise SecureAggregationError(f"SEAL stream version {major}.{minor}, expected {version[0]}.{version[1]}")
    if total != len(raw):
        raise SecureAggregationError(f"SEAL stream says {total} bytes but {len(raw)} were given")
    body = raw[HEADER.size:]
    if mode == ZSTD:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=MAX_BODY)
    if mode != NONE:
        raise SecureAggregationError(f"SEAL stream compression mode {mode} is not supported")
    return body


def _version(raw: bytes) -> tuple[int, int]:
    _, _, major, minor, _, _, _ = HEADER.unpack_from(raw)
    return major, minor


def _stream(body: bytes, version: tuple[int, int]) -> bytes:
    return HEADER.pack(MAGIC, HEADER.size, version[0], version[1], NONE, 0, HEADER.size + len(body)) + body


def _dynarray(body: bytes, offset: int, count_expected: int) -> U64:
    inner = _body(body[offset:], (0, 0))
    (count,) = COUNT.unpack_from(inner)
    if count != count_expected or len(inner) != COUNT.size + 8 * count:
        raise SecureAggregationError(f"SEAL array holds {count} values, expected {count_expected}")
    return np.frombuffer(inner, dtype="<u8", count=count, offset=COUNT.size).astype(np.uint64, copy=True)


def _dynarray_bytes(values: U64, version: tuple[int, int]) -> bytes:
    data = np.ascontiguousarray(values, dtype="<u8").tobytes()
    return _stream(COUNT.pack(values.size) + data, version)


def parse_ciphertext(raw: bytes, *, version: tuple[int, int] = (0, 0)) -> CiphertextData:
    """A saved Ciphertext or PublicKey; checks every size field against the data."""
    if len(raw) < HEADER.size:
        raise SecureAggregationError("SEAL stream is shorter than its header")
    body = _body(raw, version)
    if len(body) < PARMS.size + CT_META.size:
        raise SecureAggregationError("SEAL ciphertext stream is truncated")
    parms = PARMS.unpack_from(body)
    is_ntt, size, degree, primes, scale, correction = CT_META.unpack_from(body, PARMS.size)
    if not (1 <= size <= 16 and degree in (1024, 2048, 4096, 8192, 16384, 32768) and 1 <= primes <= 64):
        raise SecureAggregationError(f"SEAL ciphertext has an impossible shape ({size}×{primes}×{degree})")
    values = _dynarray(body, PARMS.size + CT_META.size, size * primes * degree)
    return CiphertextData(parms, bool(is_ntt), scale, values.reshape(size, primes, degree), correction)


def build_ciphertext(data: CiphertextData, *, version: tuple[int, int]) -> bytes:
    """Uncompressed stream that ``Ciphertext.load`` / ``PublicKey.load`` accept."""
    size, primes, degree = data.polys.shape
    meta = PARMS.pack(*data.parms_id) + CT_META.pack(int(data.is_ntt), size, degree, primes, data.scale, data.correction)
    return _stream(meta + _dynarray_bytes(data.polys, version), version)


def parse_plaintext(raw: bytes, *, degree: int, version: tuple[int, int] = (0, 0)) -> PlaintextData:
    """A saved NTT-form Plaintext or SecretKey (``degree`` = N splits the coefficients by prime)."""
    body = _body(raw, version)
    if len(body) < PARMS.size + PT_META.size:
        raise SecureAggregationError("SEAL plaintext stream is truncated")
    parms = PARMS.unpack_from(body)
    count, scale = PT_META.unpack_from(body, PARMS.size)
    if count == 0 or count % degree:
        raise SecureAggregationError(f"SEAL plaintext of {count} coefficients is not whole primes of degree {degree}")
    values = _dynarray(body, PARMS.size + PT_META.size, count)
    return PlaintextData(parms, scale, values.reshape(count // degree, degree))


def build_plaintext(data: PlaintextData, *, version: tuple[int, int]) -> bytes:
    meta = PARMS.pack(*data.parms_id) + PT_META.pack(data.coeffs.size, data.scale)
    return _stream(meta + _dynarray_bytes(data.coeffs, version), version)


def stream_version(raw: bytes) -> tuple[int, int]:
    """The (major, minor) SEAL version a stream was written with."""
    if len(raw) < HEADER.size:
        raise SecureAggregationError("SEAL stream is shorter than its header")
    return _version(raw)
