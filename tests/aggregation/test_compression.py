"""Update codecs against their written-out bounds, and error feedback keeping exactly what was left out."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quorumfl.aggregation.compression import (
    Encoded,
    ErrorFeedback,
    Scheme,
    decode,
    decode_arrays,
    encode,
    encode_arrays,
    gap_words,
    gaps_to_positions,
    payload_bytes,
    positions_to_gaps,
    shared_indices,
    warmup_fraction,
)
from quorumfl.errors import AggregationError, ConfigError

finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)
vectors = arrays(np.float32, st.integers(1, 400), elements=finite)
fractions = st.sampled_from([0.01, 0.05, 0.3, 1.0])


@given(vectors, fractions)
def test_topk_keeps_the_largest_entries(x: np.ndarray, fraction: float) -> None:
    enc = encode(x, Scheme.TOPK, fraction=fraction)
    out = decode(enc)
    k = max(1, int(np.ceil(fraction * x.size)))
    kept = out != 0
    idx = gaps_to_positions(enc.parts["gap"])
    assert idx.size == enc.parts["val"].size == k
    # Dropped entries are never larger than kept ones; kept ones carry float16 rounding only.
    dropped = np.setdiff1d(np.arange(x.size), idx)
    if dropped.size:
        assert np.abs(x[dropped]).max() <= np.abs(x[idx]).min()
    np.testing.assert_allclose(out[idx], x[idx].astype(np.float16).astype(np.float32), rtol=0, atol=0)
    assert np.all(np.abs(out - x)[~kept] == np.abs(x)[~kept])


@given(st.lists(vectors, min_size=1, max_size=4), fractions)
def test_model_topk_keeps_the_largest_entries_of_the_whole_update(parts: list[np.ndarray], fraction: float) -> None:
    arrays_ = {f"layer{i}": p for i, p in enumerate(parts)}
    encoded = encode_arrays(arrays_, Scheme.TOPK, fraction=fraction, seed=0)
    whole = np.concatenate([arrays_[n] for n in sorted(arrays_)])
    k = max(1, int(np.ceil(fraction * whole.size)))
    positions = {n: gaps_to_positions(encoded[n].parts["gap"]) for n in arrays_}
    kept = np.concatenate([np.abs(arrays_[n][positions[n]]) for n in sorted(arrays_)])
    assert kept.size == k
    dropped = np.concatenate([np.delete(np.abs(arrays_[n]), positions[n]) for n in sorted(arrays_)])
    if dropped.size:
        assert dropped.max() <= kept.min()
    decoded = decode_arrays(encoded, fraction=fraction, seed=0)
    for n, value in arrays_.items():
        idx = positions[n]
        np.testing.assert_array_equal(decoded[n][idx], value[idx].astype(np.float16).astype(np.float32))


@given(vectors)
def test_scaled_sign_error_identity(x: np.ndarray) -> None:
    enc = encode(x, Scheme.SIGN)
    out = decode(enc).astype(np.float64)
    x64 = x.astype(np.float64)
    scale = np.abs(x64).mean()
    assert np.all(np.abs(np.abs(out) - scale) <= 1e-6 * max(scale, 1))
    # ||x − s·sign(x)||² = ||x||² − ||x||₁² / d  (the EF-SignSGD contraction)
    lhs = np.sum((x64 - out) ** 2)
    rhs = np.sum(x64 ** 2) - np.abs(x64).sum() ** 2 / x.size
    assert lhs == pytest.approx(rhs, rel=1e-4, abs=1e-3 * max(1.0, np.sum(x64 ** 2)) * 1e-3)
    assert enc.nbytes == (x.size + 7) // 8 + 4


@given(vectors, st.integers(0, 2**31))
def test_int8_error_below_one_level(x: np.ndarray, seed: int) -> None:
    enc = encode(x, Scheme.INT8, rng=np.random.default_rng(seed))
    scale = float(enc.parts["scale"][0])
    assert np.all(np.abs(decode(enc) - x) <= scale * (1 + 1e-5) + 1e-30)
    assert enc.nbytes == x.size + 4


def test_int8_rounding_is_unbiased() -> None:
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    rng = np.random.default_rng(0)
    mean = np.mean([decode(encode(x, Scheme.INT8, rng=rng)) for _ in range(4000)], axis=0)
    step = 1 / 127
    assert np.abs(mean - x).max() < 0.05 * step * 4  # far below one level: the rounding averages out


@given(vectors, fractions, st.integers(0, 2**31))
def test_shared_randk_sums_commute(x: np.ndarray, fraction: float, seed: int) -> None:
    y = x[::-1].copy()
    ex, ey = encode(x, Scheme.RANDK, fraction=fraction, seed=seed), encode(y, Scheme.RANDK, fraction=fraction, seed=seed)
    # Every node keeps the same coordinates, so the sum of the encodings is the encoding of the sum.
    summed = Encoded(Scheme.RANDK, x.shape, {"val": (ex.parts["val"].astype(np.float32)
                                                     + ey.parts["val"].astype(np.float32))})
    idx = shared_indices(x.size, fraction, seed)
    np.testing.assert_allclose(decode(summed, fraction=fraction, seed=seed)[idx],
                               (x.astype(np.float16).astype(np.float32) + y.astype(np.float16).astype(np.float32))[idx])
    assert np.array_equal(idx, shared_indices(x.size, fraction, seed))


@settings(max_examples=50)
@given(st.lists(vectors, min_size=1, max_size=4), st.sampled_from(list(Scheme)), st.integers(0, 2**31))
def test_error_feedback_keeps_exactly_the_residual(rounds: list[np.ndarray], scheme: Scheme, seed: int) -> None:
    size = rounds[0].size
    updates = [np.resize(r, size).astype(np.float32) for r in rounds]
    feedback = ErrorFeedback(scheme, fraction=0.05)
    residual = None
    sent = np.zeros(size, np.float64)
    for i, update in enumerate(updates):
        encoded, new = feedback.step({"w": update}, residual, seed=seed + i, rng=np.random.default_rng(i))
        decoded = decode_arrays(encoded, fraction=0.05, seed=seed + i)["w"]
        corrected = update + (residual["w"] if residual else 0)
        assert np.array_equal(new["w"], (corrected - decoded).astype(np.float32))  # exactly what was left out
        sent += decoded
        residual = new
    # Nothing is lost, only delayed: what was sent plus what is kept is what was produced.
    np.testing.assert_allclose(sent + residual["w"], np.sum(updates, axis=0, dtype=np.float64), rtol=1e-4, atol=1e-2)


def test_full_sync_sends_everything_and_clears_the_residual() -> None:
    feedback = ErrorFeedback(Scheme.TOPK, fraction=0.01)
    update = {"w": np.arange(200, dtype=np.float32)}
    _, residual = feedback.step(update, None, seed=1)
    assert np.abs(residual["w"]).sum() > 0
    encoded, cleared = feedback.step(update, residual, seed=2, full=True)
    assert encoded["w"].scheme is Scheme.NONE and not np.any(cleared["w"])
    np.testing.assert_array_equal(decode(encoded["w"]), update["w"] + residual["w"])


def test_bytes_and_bad_input() -> None:
    arrays_ = {"a": np.ones((100, 100), np.float32), "b": np.ones(10, np.float32)}
    full = payload_bytes(encode_arrays(arrays_, Scheme.NONE, fraction=0.01, seed=0))
    topk = payload_bytes(encode_arrays(arrays_, Scheme.TOPK, fraction=0.01, seed=0))
    encoded = encode_arrays(arrays_, Scheme.TOPK, fraction=0.01, seed=0)
    gap_bytes = sum(e.parts["gap"].nbytes for e in encoded.values())
    assert full == 4 * 10010 and topk == 2 * 101 + gap_bytes  # float16 values + the cheaper gap words
    assert gap_bytes <= 2 * 101 + 2  # at most one uint16 per entry, and one escape per array
    with pytest.raises(AggregationError, match="NaN"):
        encode(np.array([1.0, np.nan], np.float32), Scheme.TOPK)
    with pytest.raises(AggregationError, match="indices"):
        decode(Encoded(Scheme.TOPK, (3,), {"gap": np.array([7], np.uint16), "val": np.ones(1, np.float16)}))
    with pytest.raises(AggregationError, match="indices"):  # two positions, one value
        decode(Encoded(Scheme.TOPK, (3,), {"gap": np.array([0, 0], np.uint16), "val": np.ones(1, np.float16)}))
    with pytest.raises(AggregationError, match="uint8 or uint16"):
        decode(Encoded(Scheme.TOPK, (3,), {"gap": np.array([1], np.int32), "val": np.ones(1, np.float16)}))
    with pytest.raises(ConfigError, match="compression-fraction"):
        ErrorFeedback(Scheme.TOPK, fraction=0.0)
    with pytest.raises(AggregationError, match="residual"):
        ErrorFeedback(Scheme.TOPK).step({"a": np.ones(3, np.float32)}, {"b": np.ones(3, np.float32)}, seed=0)


@given(st.lists(st.integers(0, 3 * 65535 + 7), max_size=60, unique=True),
       st.sampled_from([0, 254, 255, 256, 65534, 65535, 65536, 131070, 200000]),
       st.sampled_from([np.uint8, np.uint16]))
def test_position_gaps_round_trip(raw: list[int], far: int, word: type) -> None:
    """Any sorted distinct positions, with gaps around and beyond each word's escape, come back exactly;
    each kept entry costs one word, plus one per max(word) skipped entries."""
    positions = np.array(sorted(set(raw) | {max(raw, default=0) + far}), np.int64)
    gaps = positions_to_gaps(positions, word)
    assert gaps.dtype == word
    np.testing.assert_array_equal(gaps_to_positions(gaps), positions)
    skipped = np.diff(positions, prepend=-1) - 1
    assert gaps.size == positions.size + int((skipped // np.iinfo(word).max).sum())
    chosen = gap_words([positions])  # the cheaper word is never more bytes than the other one
    for other in (np.uint8, np.uint16):
        assert positions_to_gaps(positions, chosen).nbytes <= positions_to_gaps(positions, other).nbytes


def test_warmup_fraction_follows_deep_gradient_compression() -> None:
    assert [warmup_fraction(0.01, r, 4) for r in range(1, 7)] == [0.25, 0.0625, 0.015625, 0.01, 0.01, 0.01]
    assert [warmup_fraction(0.1, r, 3) for r in (1, 2, 3)] == [0.25, 0.1, 0.1]  # never below the fraction
    assert warmup_fraction(0.01, 1, 0) == 0.01
