"""Who masks with whom and who holds whose shares: the neighbour graph of a key epoch.

Small cohorts use the complete graph (SecAgg, Bonawitz et al. 2017). Large cohorts use a random
k-regular graph with k ≈ 2·⌈log2 n⌉ (SecAgg+, Bell et al. 2020): every node does O(log n) key
agreements and holds O(log n) shares instead of O(n). The sparse graph is a circulant graph
(offsets drawn at random) relabelled by a random permutation, both from the epoch's public seed,
so server and nodes compute the same graph without sending it.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import SecureAggregationError

__all__ = ["COMPLETE_UP_TO", "neighbour_graph", "sparse_degree", "share_threshold"]

COMPLETE_UP_TO = 100  # cohorts up to this size use the complete graph


def sparse_degree(n: int) -> int:
    """The degree of the random graph for a cohort of ``n`` (even, at most n − 2)."""
    return max(2, min(2 * math.ceil(math.log2(n)), n - 2 - (n % 2)))


def neighbour_graph(n: int, *, seed: bytes, complete_up_to: int = COMPLETE_UP_TO) -> list[frozenset[int]]:
    """Neighbours of each cohort index 0..n−1 (a node is never its own neighbour)."""
    if n < 2:
        raise SecureAggregationError(f"a cohort needs at least 2 nodes, got {n}")
    if n <= complete_up_to:
        return [frozenset(j for j in range(n) if j != i) for i in range(n)]
    k = sparse_degree(n)
    rng = np.random.default_rng(int.from_bytes(seed, "big"))
    offsets = [int(o) for o in rng.choice(np.arange(1, (n - 1) // 2 + 1), size=k // 2, replace=False)]
    label = [int(x) for x in rng.permutation(n)]
    graph: list[set[int]] = [set() for _ in range(n)]
    for position in range(n):
        for offset in offsets:
            a, b = label[position], label[(position + offset) % n]
            graph[a].add(b)
            graph[b].add(a)
    return [frozenset(g) for g in graph]


def share_threshold(threshold: int, n: int, holders: int) -> int:
    """Shares needed to rebuild a secret held by ``holders`` nodes of an ``n``-node cohort.

    The complete graph gives the cohort threshold itself; a sparse graph scales it to the
    neighbourhood and never goes below a majority of the holders.
    """
    return max(holders // 2 + 1, math.ceil(threshold * holders / n))
