"""Residues on the wire at 60 bits each instead of 64: two residues in 15 bytes.

Every prime of a parameter set has at most 60 bits (``CkksParams`` refuses larger ones), so a
reduced residue fits in 60 bits and the top 4 bits of each uint64 are always zero. Ciphertexts,
the aggregate's c1 and partial decryptions are by far the largest CKKS messages; packing pairs
of residues into 15 bytes cuts them by 1/16. numpy has no packing for arbitrary bit widths
(``packbits`` works bit by bit, 64× the memory), so this is written here: a few shifts per pair and
unaligned 8-byte views every 15 bytes (about 30 ms each way for a 32 MB ciphertext vector).

Layout: the last axis (N residues, N even) becomes 15·N/2 bytes; pair (a, b) is written as the
8 little-endian bytes of ``a | (b mod 16) << 60`` followed by the low 7 bytes of ``b >> 4``. The
shape of the other axes is kept, so a packed array says its own shape.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import SecureAggregationError

__all__ = ["RESIDUE_BITS", "pack_residues", "unpack_residues"]

RESIDUE_BITS = 60
_LOW60 = np.uint64((1 << RESIDUE_BITS) - 1)
_PAIR_BYTES = 15

U64 = NDArray[np.uint64]
U8 = NDArray[np.uint8]


def pack_residues(residues: U64) -> U8:
    """``[..., N]`` uint64 residues (each < 2^60, N even) as ``[..., 15·N/2]`` bytes."""
    if residues.dtype != np.uint64 or residues.ndim < 1 or residues.shape[-1] % 2:
        raise SecureAggregationError(f"cannot pack residues of dtype {residues.dtype} and shape {residues.shape}: "
                                     "uint64 with an even last axis is needed")
    flat = np.ascontiguousarray(residues).reshape(-1, 2)
    a, b = flat[:, 0], flat[:, 1]
    if flat.size and flat.max() > _LOW60:
        raise SecureAggregationError("a residue has more than 60 bits: it is not reduced modulo a CKKS prime")
    pairs = flat.shape[0]
    word0 = np.bitwise_and(b, np.uint64(0xF))  # two temporaries in all, shifted and combined in place
    np.left_shift(word0, np.uint64(RESIDUE_BITS), out=word0)
    np.bitwise_or(word0, a, out=word0)
    word1 = np.right_shift(b, np.uint64(4))
    # Unaligned 8-byte views every 15 bytes; the high word of each pair is written first, its top
    # byte (always 0) spilling onto the next pair's first byte, which the low words then overwrite.
    buffer = np.zeros(pairs * _PAIR_BYTES + 1, dtype=np.uint8)
    np.ndarray((pairs,), dtype="<u8", buffer=buffer, offset=8, strides=(_PAIR_BYTES,))[:] = word1
    np.ndarray((pairs,), dtype="<u8", buffer=buffer, offset=0, strides=(_PAIR_BYTES,))[:] = word0
    return buffer[:-1].reshape(*residues.shape[:-1], residues.shape[-1] // 2 * _PAIR_BYTES)


def unpack_residues(packed: U8) -> U64:
    """The inverse of ``pack_residues``; refuses a byte count that is not a whole number of pairs."""
    if packed.dtype != np.uint8 or packed.ndim < 1 or packed.shape[-1] % _PAIR_BYTES:
        raise SecureAggregationError(f"packed residues of dtype {packed.dtype} and shape {packed.shape}: "
                                     f"uint8 with a last axis in multiples of {_PAIR_BYTES} bytes is needed")
    count = packed.size // _PAIR_BYTES
    buffer = np.empty(packed.size + 1, dtype=np.uint8)  # one spare byte: the last high word reads 8
    buffer[:-1] = packed.reshape(-1)
    buffer[-1] = 0
    word0 = np.ndarray((count,), dtype="<u8", buffer=buffer, offset=0, strides=(_PAIR_BYTES,))
    word1 = np.ndarray((count,), dtype="<u8", buffer=buffer, offset=8, strides=(_PAIR_BYTES,))
    out = np.empty((count, 2), dtype=np.uint64)
    np.bitwise_and(word0, _LOW60, out=out[:, 0])
    np.right_shift(word0, np.uint64(RESIDUE_BITS), out=out[:, 1])
    high = np.bitwise_and(word1, np.uint64((1 << 56) - 1))  # the 8th byte read belongs to the next pair
    np.left_shift(high, np.uint64(4), out=high)
    np.bitwise_or(out[:, 1], high, out=out[:, 1])
    return out.reshape(*packed.shape[:-1], packed.shape[-1] // _PAIR_BYTES * 2)
