"""Delta of one edge artifact against another: what a device that holds version v downloads to get v+1.

The delta is the byte-wise XOR of the new artifact with the one the device holds (cut or padded
with zeros to the new length), compressed with zlib. Two exports of the same architecture lay their
tensors out at the same offsets, and a federated round moves few INT8 weights by a whole
quantisation step, so the XOR is mostly zero bytes and compresses to a fraction of the artifact
(``benchmarks/edge.py``: ``delta_sync_bytes`` against ``full_sync_bytes``). A chunk-hash scheme
(rsync, zsync) would find almost no identical chunks here: after a round nearly every 4 KiB block
holds some changed weight.

The delta carries no signature of its own and needs none: the device rebuilds the whole artifact
and checks it against the size and SHA-256 of the signed manifest before it is used, exactly as a
full download is checked, so a tampered delta yields a refused artifact, never a wrong one.
``decode`` bounds its output to the manifest's size, so a crafted delta cannot inflate without
limit. zlib rather than a newer codec: it is in the standard library on every device, and its output
is the same for the same input, which a resumed download relies on (the server recomputes the delta
and the device asks for the bytes from where it stopped). Pure: no I/O.
"""

from __future__ import annotations

import zlib

import numpy as np

from quorumfl.errors import ArtifactError

__all__ = ["decode", "encode"]

# A whole artifact travels the same way, as its delta against nothing (b""): a zlib stream of the
# file, which the zeros of a pruned INT8 model shrink (``edge.qat`` ``sparsity``).

LEVEL = 9


def _xor(payload: bytes, base: bytes) -> bytes:
    new = np.frombuffer(payload, dtype=np.uint8)
    old = np.zeros(len(payload), dtype=np.uint8)
    shared = min(len(payload), len(base))
    old[:shared] = np.frombuffer(base, dtype=np.uint8, count=shared)
    return np.bitwise_xor(new, old).tobytes()


def encode(payload: bytes, base: bytes) -> bytes:
    """The delta that turns ``base`` into ``payload``."""
    return zlib.compress(_xor(payload, base), LEVEL)


def decode(delta: bytes, base: bytes, size: int) -> bytes:
    """Rebuild an artifact of ``size`` bytes from ``delta`` and ``base``; raises ``ArtifactError`` for
    a delta that is not zlib data or does not inflate to exactly ``size`` bytes (the caller still
    checks the SHA-256)."""
    inflate = zlib.decompressobj()
    try:
        xored = inflate.decompress(delta, size + 1)
    except zlib.error as exc:
        raise ArtifactError(f"the downloaded zlib stream is damaged ({exc}); it is refused and the installed model "
                            "kept") from None
    if len(xored) != size or not inflate.eof or inflate.unconsumed_tail or inflate.unused_data:
        raise ArtifactError(f"the downloaded zlib stream does not rebuild a {size}-byte artifact; it is refused and "
                            "the installed model kept")
    return _xor(xored, base)
