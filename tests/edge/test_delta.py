"""Artifact deltas on their own: any new artifact is rebuilt exactly from any base, and a delta that
is cut, altered or inflates past the artifact's size is refused (the caller then also checks the
SHA-256 of what was rebuilt)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.edge.delta import decode, encode
from quorumfl.errors import ArtifactError


@settings(max_examples=60, deadline=None)
@given(new=st.binary(min_size=1, max_size=3000), base=st.binary(max_size=3000))
def test_any_artifact_is_rebuilt_from_any_base(new: bytes, base: bytes) -> None:
    assert decode(encode(new, base), base, len(new)) == new


def test_a_federated_update_of_int8_weights_makes_a_small_delta() -> None:
    rng = np.random.default_rng(0)
    old = rng.integers(-63, 64, 200_000, dtype=np.int8)
    new = old.copy()
    moved = rng.random(old.size) < 0.1  # a round moves one weight in ten by one quantisation step
    new[moved] += rng.choice(np.array([-1, 1], dtype=np.int8), int(moved.sum()))
    d = encode(new.tobytes(), old.tobytes())
    assert len(d) < 0.3 * new.nbytes  # against a plain numpy reference: the whole artifact
    assert decode(d, old.tobytes(), new.nbytes) == new.tobytes()


def test_a_cut_altered_or_inflating_delta_is_refused() -> None:
    base, new = bytes(range(256)) * 40, bytes(reversed(range(256))) * 40
    d = encode(new, base)
    with pytest.raises(ArtifactError, match="does not rebuild"):
        decode(d[: len(d) // 2], base, len(new))  # cut: the stream does not end
    with pytest.raises(ArtifactError, match="damaged"):
        decode(d[:10] + bytes([d[10] ^ 0x40]) + d[11:], base, len(new))
    with pytest.raises(ArtifactError, match="does not rebuild"):
        decode(zlib.compress(bytes(10**7)), base, len(new))  # 10 MB of zeros for a 10 KB artifact: bounded
    with pytest.raises(ArtifactError, match="does not rebuild"):
        decode(d + b"trailing", base, len(new))
