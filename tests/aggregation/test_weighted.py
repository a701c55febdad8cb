"""Weighted mean against a plain numpy reference, and rejection of bad updates."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.aggregation import (
    AggregationError,
    EmptyAggregationError,
    NodeUpdate,
    WeightedMean,
    aggregate_weighted_mean,
    aggregate_weighted_metrics,
)
from quorumfl.aggregation.weighted import BLOCK, BLOCKS, LARGE, error_bound


def _updates(rng: np.random.Generator, n: int, shapes: dict[str, tuple[int, ...]]) -> list[NodeUpdate]:
    return [
        NodeUpdate(
            node=f"n{i}",
            arrays={k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()},
            weight=float(rng.integers(1, 500)),
        )
        for i in range(n)
    ]


def _reference(updates: list[NodeUpdate]) -> dict[str, np.ndarray]:
    weights = np.array([u.weight for u in updates], dtype=np.float64)
    return {
        k: np.tensordot(weights / weights.sum(), np.stack([u.arrays[k].astype(np.float64) for u in updates]), axes=1)
        for k in updates[0].arrays
    }


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
    shapes=st.dictionaries(
        st.sampled_from(["w", "b", "conv.weight", "bn"]),
        st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple),
        min_size=1,
    ),
)
def test_matches_numpy_reference(n: int, seed: int, shapes: dict[str, tuple[int, ...]]) -> None:
    updates = _updates(np.random.default_rng(seed), n, shapes)
    result = aggregate_weighted_mean(updates)
    reference = _reference(updates)
    assert set(result) == set(reference)
    for key in reference:
        assert result[key].dtype == np.float32
        np.testing.assert_allclose(result[key], reference[key], rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), perm_seed=st.integers(0, 1000))
def test_order_invariant(seed: int, perm_seed: int) -> None:
    updates = _updates(np.random.default_rng(seed), 5, {"w": (3, 4), "b": (4,)})
    shuffled = [updates[i] for i in np.random.default_rng(perm_seed).permutation(len(updates))]
    a, b = aggregate_weighted_mean(updates), aggregate_weighted_mean(shuffled)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7)


def test_equal_weights_is_plain_mean() -> None:
    ups = [NodeUpdate(str(i), {"w": np.full(3, float(i), np.float32)}, 10) for i in range(4)]
    np.testing.assert_array_equal(aggregate_weighted_mean(ups)["w"], np.full(3, 1.5, np.float32))


@pytest.mark.parametrize(
    ("arrays", "weight", "needle"),
    [
        ({"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}, 5, "shape mismatch for 'w'"),
        ({"w": np.array([[np.nan, 0], [0, 0]], np.float32), "b": np.zeros(3, np.float32)}, 5, "non-finite"),
        ({"w": np.full((2, 2), np.inf, np.float32), "b": np.zeros(3, np.float32)}, 5, "non-finite"),
        ({"w": np.zeros((2, 2), np.float32)}, 5, "missing ['b']"),
        ({"w": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float32), "x": np.zeros(1)}, 5, "unexpected ['x']"),
        ({}, 5, "empty"),
        ({"w": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float32)}, 0, "positive"),
        ({"w": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float32)}, -3, "positive"),
        ({"w": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float32)}, math.nan, "positive"),
        ({"w": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float32)}, True, "number"),
    ],
)
def test_bad_update_is_rejected_naming_node_and_leaves_sums_untouched(
    arrays: dict[str, np.ndarray], weight: float, needle: str
) -> None:
    template = {"w": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float32)}
    mean = WeightedMean(template)
    good = NodeUpdate("tax-office", {"w": np.ones((2, 2), np.float32), "b": np.ones(3, np.float32)}, 10)
    mean.add(good)
    with pytest.raises(AggregationError) as info:
        mean.add(NodeUpdate("planning", arrays, weight))
    assert "node planning" in str(info.value) and needle in str(info.value)
    assert info.value.node == "planning"
    result = mean.result()
    np.testing.assert_array_equal(result["w"], np.ones((2, 2), np.float32))
    assert mean.nodes == ["tax-office"]


def test_empty_aggregation_raises() -> None:
    with pytest.raises(EmptyAggregationError):
        aggregate_weighted_mean([])
    with pytest.raises(EmptyAggregationError):
        WeightedMean({"w": np.zeros(2)}).result()


def test_same_node_twice_is_rejected() -> None:
    mean = WeightedMean({"w": np.zeros(2)})
    mean.add(NodeUpdate("a", {"w": np.ones(2)}, 1))
    with pytest.raises(AggregationError, match="same node"):
        mean.add(NodeUpdate("a", {"w": np.ones(2)}, 1))


def test_weighted_metrics() -> None:
    result = aggregate_weighted_metrics([("a", {"loss": 1.0, "acc": 0.5}, 1), ("b", {"loss": 3.0}, 3)])
    assert result == {"loss": pytest.approx(2.5), "acc": pytest.approx(0.5)}
    with pytest.raises(AggregationError, match="node b"):
        aggregate_weighted_metrics([("b", {"loss": math.inf}, 1)])


# ---- large float32 tensors: BLAS finiteness check and blocked float32 summation ------------------
LARGE_SHAPES = {"w": (128, (LARGE // 128) + 3), "b": (7,)}  # one tensor on the BLAS path, one on the exact path


@settings(max_examples=8, deadline=None)
@given(n=st.integers(1, 2 * BLOCK + 3), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-4, 1.0, 1e3]))
def test_large_tensors_are_within_the_documented_bound_of_the_float64_reference(n: int, seed: int, scale: float) -> None:
    rng = np.random.default_rng(seed)
    updates = [NodeUpdate(f"n{i}", {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in LARGE_SHAPES.items()},
                          float(rng.integers(1, 5000))) for i in range(n)]
    result = aggregate_weighted_mean(updates)
    reference = _reference(updates)
    weights = [u.weight for u in updates]
    magnitudes = np.sum([u.weight * np.abs(u.arrays["w"].astype(np.float64)) for u in updates], axis=0)
    bound = error_bound(weights, magnitudes)
    error = np.abs(result["w"].astype(np.float64) - reference["w"])
    assert np.all(error <= bound), float(np.max(error / bound))
    np.testing.assert_allclose(result["b"], reference["b"], rtol=1e-5, atol=1e-6 * scale)


def test_large_tensors_without_the_block_flush_would_be_wrong() -> None:
    """The float64 sums see every block and every partial sum: 3·BLOCK·BLOCKS + BLOCK + 1 updates of
    ones average to exactly one, whether added one by one or in batches."""
    ones = np.ones(LARGE, np.float32)
    updates = [NodeUpdate(f"n{i}", {"w": ones}, 3.0) for i in range(3 * BLOCK * BLOCKS + BLOCK + 1)]
    np.testing.assert_array_equal(aggregate_weighted_mean(updates)["w"], ones)
    batched = WeightedMean({"w": ones})
    assert not batched.extend(updates[:100]) and not batched.extend(updates[100:])
    np.testing.assert_array_equal(batched.result()["w"], ones)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("count", [2, BLOCK + 1, BLOCK * BLOCKS + 3])
def test_updates_whose_large_tensor_comes_in_another_dtype_all_count(batched: bool, count: int) -> None:
    """A node may send a large tensor as float64 (the exact path) while the others send float32 (the
    BLAS path): the mean counts both, before and after the float64 flush, in the template's dtype."""
    rng = np.random.default_rng(count)
    updates = [NodeUpdate(f"n{i}", {"w": rng.standard_normal(LARGE + 3).astype(np.float64 if i % 3 == 0 else np.float32)},
                          float(rng.integers(1, 50))) for i in range(count)]
    mean = WeightedMean({"w": np.zeros(LARGE + 3, np.float32)})
    if batched:
        assert not mean.extend(updates)
    else:
        for update in updates:
            mean.add(update)
    result = mean.result()["w"]
    assert result.dtype == np.float32
    np.testing.assert_allclose(result, _reference(updates)["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batched", [False, True])
def test_a_mean_across_the_float64_flush_is_within_the_documented_bound(batched: bool) -> None:
    """More updates than one float32 partial sum holds (BLOCK·BLOCKS), with magnitudes spread over
    six orders, so each level's rounding shows; the bound holds against the float64 reference."""
    rng = np.random.default_rng(7)
    n = BLOCK * BLOCKS + BLOCK + 3
    updates = [NodeUpdate(f"n{i}", {k: (10.0 ** rng.uniform(-3, 3) * rng.standard_normal(s)).astype(np.float32)
                                    for k, s in LARGE_SHAPES.items()}, float(rng.integers(1, 5000))) for i in range(n)]
    if batched:
        mean = WeightedMean(updates[0].arrays)
        assert not mean.extend(updates)
        result = mean.result()
    else:
        result = aggregate_weighted_mean(updates)
    magnitudes = np.sum([u.weight * np.abs(u.arrays["w"].astype(np.float64)) for u in updates], axis=0)
    error = np.abs(result["w"].astype(np.float64) - _reference(updates)["w"])
    assert np.all(error <= error_bound([u.weight for u in updates], magnitudes))
    assert result["w"].dtype == np.float32 and result["w"].shape == LARGE_SHAPES["w"]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_large_tensor_with_one_bad_value_is_refused_and_leaves_the_sums_untouched(bad: float) -> None:
    good = np.full(LARGE + 5, 2.0, np.float32)
    poisoned = good.copy()
    poisoned[LARGE // 2] = bad
    mean = WeightedMean({"w": good})
    mean.add(NodeUpdate("tax-office", {"w": good}, 10))
    with pytest.raises(AggregationError, match="1 non-finite") as info:
        mean.add(NodeUpdate("planning", {"w": poisoned}, 10))
    assert info.value.node == "planning"
    np.testing.assert_array_equal(mean.result()["w"], good)


def test_huge_finite_values_whose_squares_overflow_are_still_accepted() -> None:
    big = np.full(LARGE, 1e30, np.float32)  # x·x overflows float32; the element-wise check decides
    assert aggregate_weighted_mean([NodeUpdate("a", {"w": big}, 1.0)])["w"][0] == np.float32(1e30)


def _poison(update: NodeUpdate, name: str, index: int, value: float) -> NodeUpdate:
    arrays = {k: v.copy() for k, v in update.arrays.items()}
    arrays[name].reshape(-1)[index] = value
    return NodeUpdate(update.node, arrays, update.weight)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 2 * BLOCK + 5), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_extend_accepts_and_averages_exactly_what_add_one_by_one_does(n: int, seed: int, data: st.DataObject) -> None:
    """The batched check (one dot product per block) against the per-update one: the same nodes are
    rejected wherever the bad values sit (NaN, ±inf, one or several per batch, in the large or the
    small tensor, a repeated node, a bad weight), and the accepted updates' mean is the numpy reference."""
    rng = np.random.default_rng(seed)
    updates = _updates(rng, n, LARGE_SHAPES)
    for i in data.draw(st.sets(st.integers(0, n - 1), max_size=min(n, 6))):
        kind = data.draw(st.sampled_from(["nan", "inf", "-inf", "small", "weight", "repeat"]))
        if kind == "weight":
            updates[i] = NodeUpdate(updates[i].node, updates[i].arrays, -1.0)
        elif kind == "repeat" and i > 0:
            updates[i] = NodeUpdate(updates[i - 1].node, updates[i].arrays, updates[i].weight)
        elif kind == "small":
            updates[i] = _poison(updates[i], "b", 3, np.nan)
        elif kind != "repeat":
            updates[i] = _poison(updates[i], "w", int(rng.integers(0, LARGE)), float(kind))
    one_by_one = WeightedMean(updates[0].arrays)
    accepted, expected_rejected = [], set()
    for update in updates:
        try:
            one_by_one.add(update)
        except AggregationError:
            expected_rejected.add(update.node)
        else:
            accepted.append(update)
    batched = WeightedMean(updates[0].arrays)
    rejected = batched.extend(updates)
    assert batched.nodes == one_by_one.nodes == [u.node for u in accepted]
    assert set(rejected) == expected_rejected and all(rejected.values())
    if not accepted:
        with pytest.raises(EmptyAggregationError):
            batched.result()
        return
    result, reference = batched.result(), _reference(accepted)
    magnitudes = np.sum([u.weight * np.abs(u.arrays["w"].astype(np.float64)) for u in accepted], axis=0)
    assert np.all(np.abs(result["w"].astype(np.float64) - reference["w"]) <= error_bound([u.weight for u in accepted],
                                                                                          magnitudes))
    np.testing.assert_allclose(result["b"], reference["b"], rtol=1e-5, atol=1e-6)


def test_extend_after_add_keeps_what_add_accumulated() -> None:
    """A batch with a bad update is redone; the updates added before it stay in the sums."""
    good = np.full(LARGE, 2.0, np.float32)
    mean = WeightedMean({"w": good})
    mean.add(NodeUpdate("first", {"w": good}, 1.0))
    rejected = mean.extend([NodeUpdate("bad", {"w": _poison(NodeUpdate("x", {"w": good}, 1), "w", 0, np.inf).arrays["w"]}, 1.0),
                            NodeUpdate("second", {"w": 2 * good}, 1.0)])
    assert list(rejected) == ["bad"] and "1 non-finite" in rejected["bad"]
    assert mean.nodes == ["first", "second"]
    np.testing.assert_array_equal(mean.result()["w"], np.full(LARGE, 3.0, np.float32))


def test_a_result_is_never_changed_by_later_terms_or_by_later_means() -> None:
    """The float32 blocks and partial sums are reused in place: a result the caller holds must share no
    memory with them and stay what it was, whatever is summed afterwards, by this mean or the next."""
    import gc

    rng = np.random.default_rng(7)
    shapes = {"w": (LARGE + 3,), "b": (5,)}
    first, more, other = (_updates(rng, n, shapes) for n in (BLOCK + 3, 4, BLOCK * 2 + 1))
    more = [NodeUpdate(f"m{i}", u.arrays, u.weight) for i, u in enumerate(more)]
    mean = WeightedMean(first[0].arrays)
    assert not mean.extend(first)
    early = mean.result()
    early_copy = {k: v.copy() for k, v in early.items()}
    assert not mean.extend(more)
    both = mean.result()
    del mean
    gc.collect()  # its memory is free for the next mean's
    later = aggregate_weighted_mean(other)
    for key, value in _reference(first).items():
        np.testing.assert_array_equal(early[key], early_copy[key])
        np.testing.assert_allclose(early[key], value, rtol=1e-5, atol=1e-6)
    for key, value in _reference(first + more).items():
        np.testing.assert_allclose(both[key], value, rtol=1e-5, atol=1e-6)
    for key, value in _reference(other).items():
        np.testing.assert_allclose(later[key], value, rtol=1e-5, atol=1e-6)
    assert not np.shares_memory(early["w"], both["w"]) and not np.shares_memory(both["w"], later["w"])


def test_a_dropped_means_blocks_serve_the_next_mean_and_the_pool_keeps_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dropped mean's float32 blocks go to the pool (up to its limit) and the next mean takes them
    instead of new memory; the block ``result`` handed out never goes there."""
    import gc

    from quorumfl.aggregation import weighted

    pool = weighted._BlockPool(4 * LARGE)  # room for one block
    monkeypatch.setattr(weighted, "_POOL", pool)
    rng = np.random.default_rng(3)
    updates = _updates(rng, BLOCK + 1, {"w": (LARGE,)})  # two flushes: a block and a partial sum
    mean = WeightedMean(updates[0].arrays)
    assert not mean.extend(updates)
    first = mean.result()  # divided into the spare block, which the caller now holds
    kept = first["w"].copy()
    del mean
    gc.collect()
    assert pool._bytes == 4 * LARGE and len(pool._free[LARGE]) == 1  # the partial sum; the result is not there
    pooled = pool._free[LARGE][0]
    again = WeightedMean(updates[0].arrays)
    again.add(updates[1])
    assert pool._bytes == 0 and again._blocks["w"] is pooled
    np.testing.assert_array_equal(first["w"], kept)
    np.testing.assert_allclose(again.result()["w"], updates[1].arrays["w"], rtol=1e-6)
    full = weighted._BlockPool(0)  # a pool with no room frees what it is given
    full.give({"w": pooled})
    assert not full._free and full._bytes == 0
