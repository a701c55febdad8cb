"""IFCA cluster math against plain numpy: assignment, per-cluster means, repairs, purity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.aggregation.clustering import (
    ClusteredMean,
    choose_cluster,
    cluster_purity,
    repair_clusters,
)
from quorumfl.aggregation.weighted import NodeUpdate
from quorumfl.errors import AggregationError, EmptyAggregationError

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@given(st.lists(finite, min_size=1, max_size=8))
def test_choose_cluster_is_the_lowest_loss_first_on_ties(losses: list[float]) -> None:
    assert choose_cluster(losses) == int(np.argmin(losses))


def test_choose_cluster_skips_non_finite_losses_and_refuses_when_none_is_finite() -> None:
    assert choose_cluster([math.nan, 3.0, math.inf, 1.0]) == 3
    with pytest.raises(AggregationError, match="finite"):
        choose_cluster([math.nan, math.inf])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.integers(0, 3), st.floats(0.5, 100.0)), min_size=1, max_size=12),
       st.integers(0, 2**32 - 1))
def test_per_cluster_aggregation_equals_per_cluster_numpy_means(
    clusters: int, nodes: list[tuple[int, float]], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    template = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
    mean = ClusteredMean([template] * clusters)
    reference: dict[int, list[tuple[dict[str, np.ndarray], float]]] = {}
    for i, (raw, weight) in enumerate(nodes):
        cluster = raw % clusters
        arrays = {"w": rng.normal(size=(3, 2)).astype(np.float32), "b": rng.normal(size=2).astype(np.float32)}
        mean.add(cluster, NodeUpdate(str(i), arrays, weight))
        reference.setdefault(cluster, []).append((arrays, weight))
    results = mean.results()
    assert set(results) == set(reference)
    for cluster, items in reference.items():
        for name in template:
            expected = sum(w * a[name].astype(np.float64) for a, w in items) / sum(w for _, w in items)
            np.testing.assert_allclose(results[cluster][name], expected, rtol=1e-5, atol=1e-6)


def test_a_bad_cluster_id_or_update_is_rejected_and_changes_nothing() -> None:
    mean = ClusteredMean([{"w": np.zeros(2)}] * 2)
    for cluster in (2, -1, True):
        with pytest.raises(AggregationError):
            mean.add(cluster, NodeUpdate("a", {"w": np.ones(2)}, 1.0))
    with pytest.raises(AggregationError):
        mean.add(0, NodeUpdate("a", {"w": np.array([np.nan, 1.0])}, 1.0))
    with pytest.raises(EmptyAggregationError):
        mean.results()


def test_an_empty_cluster_is_re_seeded_from_the_largest_and_a_collapsed_one_too() -> None:
    rng = np.random.default_rng(0)
    base = {"w": rng.normal(size=50)}
    distinct = {"w": rng.normal(size=50) * 3}
    twin = {"w": base["w"] * (1 + 1e-4)}
    models, repairs = repair_clusters([base, distinct, {"w": np.zeros(50)}, twin], [5, 3, 0, 2],
                                      merge_distance=1e-2, noise=0.05, rng=rng)
    assert [(r.cluster, r.reason, r.seeded_from) for r in repairs] == [
        (2, "empty", 0), (3, "collapsed into cluster 0", 0)]
    np.testing.assert_array_equal(models[1]["w"], distinct["w"])
    for k in (0, 2, 3):  # near the largest cluster's model, but not equal to it
        gap = np.linalg.norm(models[k]["w"] - base["w"]) / np.linalg.norm(base["w"])
        assert 0 < gap < 0.2
    # The largest and the first re-seeded cluster are its two halves: base − δ and base + δ.
    np.testing.assert_allclose(models[0]["w"] + models[2]["w"], 2 * base["w"], rtol=0, atol=1e-12)


def test_purity_counts_each_clusters_majority_group() -> None:
    assert cluster_purity([0, 0, 1, 1], [5, 5, 7, 7]) == 1.0  # cluster ids need not match group ids
    assert cluster_purity([0, 0, 0, 1], [1, 1, 2, 2]) == 0.75
    assert cluster_purity([0, 0, 0, 0], [1, 1, 2, 2]) == 0.5
    with pytest.raises(AggregationError):
        cluster_purity([0], [0, 1])
