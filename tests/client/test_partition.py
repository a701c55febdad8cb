"""Partitioner properties (hypothesis): exact cover, determinism, label limits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from quorumfl.core.data.partition import partition
from quorumfl.errors import ConfigError

labels_st = st.integers(0, 2**16).map(lambda s: np.random.default_rng(s).integers(0, 10, size=400))


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n
    assert np.array_equal(np.sort(joined), np.arange(n))


@settings(max_examples=40, deadline=None)
@given(labels=labels_st, nodes=st.integers(1, 12), seed=st.integers(0, 10_000), method=st.sampled_from(["iid", "dirichlet", "shards"]),
       alpha=st.floats(0.05, 10.0), k=st.integers(1, 10))
def test_cover_and_determinism(labels: np.ndarray, nodes: int, seed: int, method: str, alpha: float, k: int) -> None:
    if method == "shards" and nodes * k < 10:
        k = -(-10 // nodes)
    parts = partition(labels, nodes, method=method, seed=seed, alpha=alpha, labels_per_node=k)
    again = partition(labels, nodes, method=method, seed=seed, alpha=alpha, labels_per_node=k)
    assert len(parts) == nodes
    _assert_exact_cover(parts, len(labels))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@settings(max_examples=40, deadline=None)
@given(labels=labels_st, nodes=st.integers(5, 12), k=st.integers(1, 3), seed=st.integers(0, 10_000))
def test_shards_give_exactly_k_labels(labels: np.ndarray, nodes: int, k: int, seed: int) -> None:
    assume(nodes * k >= 10)
    parts = partition(labels, nodes, method="shards", seed=seed, labels_per_node=k)
    for part in parts:
        assert len(np.unique(labels[part])) <= k


@settings(max_examples=25, deadline=None)
@given(labels=labels_st, seed=st.integers(0, 10_000))
def test_iid_sizes_are_balanced(labels: np.ndarray, seed: int) -> None:
    sizes = [len(p) for p in partition(labels, 7, method="iid", seed=seed)]
    assert max(sizes) - min(sizes) <= 1


def test_small_alpha_skews_more_than_large_alpha() -> None:
    labels = np.random.default_rng(0).integers(0, 10, size=5000)

    def mean_distinct(alpha: float) -> float:
        parts = partition(labels, 10, method="dirichlet", seed=1, alpha=alpha)
        return float(np.mean([(np.bincount(labels[p], minlength=10) > len(p) * 0.02).sum() for p in parts]))

    assert mean_distinct(0.05) < mean_distinct(100.0)


def test_different_seeds_differ() -> None:
    labels = np.random.default_rng(0).integers(0, 10, size=500)
    a = partition(labels, 4, method="dirichlet", seed=1, alpha=0.5)
    b = partition(labels, 4, method="dirichlet", seed=2, alpha=0.5)
    assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"method": "zipf"}, "unknown partitioner 'zipf'"),
        ({"method": "dirichlet", "alpha": 0.0}, "alpha must be > 0"),
        ({"method": "shards", "labels_per_node": 1}, "cannot cover 10 classes"),
        ({"method": "shards", "labels_per_node": 11}, "labels_per_node must be in 1..10"),
    ],
)
def test_bad_settings_raise(kwargs: dict, needle: str) -> None:
    labels = np.arange(100) % 10
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("'", "'")):
        partition(labels, 3, seed=0, **kwargs)


def test_more_nodes_than_samples() -> None:
    with pytest.raises(ConfigError, match="cannot be shared"):
        partition(np.zeros(3, dtype=int), 5, method="iid", seed=0)
