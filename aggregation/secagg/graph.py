"""Who masks with whom and who holds whose shares: the neighbour graph of a key epoch.

Small cohorts use the complete graph (SecAgg, Bonawitz et al. 2017): t − 1 colluders hold t − 1
shares of any secret, one too few. Large cohorts may use a sparse graph (SecAgg+, Bell et al. CCS
2020): every node agrees keys with and hands shares to k neighbours only, and ``t_local`` of its
k + 1 holders (the neighbours and itself) rebuild its secrets. Neither k nor t_local is fixed by
habit: ``sparse_parameters`` derives them from the run's assumed colluding fraction γ, dropout
fraction δ and a security parameter, as the smallest k for which

- security: the union bound over the n nodes of P[at least t_local of a node's k neighbours
  collude] is at most 2^−security_bits (those colluders alone could rebuild both of its secrets);
- liveness: the union bound of P[fewer than t_local of a node's k neighbours are honest and still
  there] is at most 2^−liveness_bits (else its secrets could not be rebuilt when it drops).

The probabilities are exact hypergeometric tails in integer arithmetic (``exposure_probability``).
Where no sparse graph meets both (or it would be nearly complete), the complete graph is used.

The sparse graph is the Harary graph H(k, n) (each position joined to the k/2 nearest on either side
of a ring: k-connected, so never disconnected) relabelled by a random permutation drawn from the
epoch's seed. Under a uniformly random relabelling a node's neighbours are a uniformly random
k-subset of the others, which is what the tails above assume; server and nodes compute the same
graph from the seed without sending it. The seed is the server's: a server that grinds seeds to
place colluders next to one department is outside this bound (docs/explanation/security.md says so).
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

import numpy as np

from quorumfl.errors import SecureAggregationError

__all__ = [
    "COMPLETE_UP_TO",
    "exposure_probability",
    "liveness_failure_probability",
    "neighbour_graph",
    "neighbours_of",
    "share_threshold",
    "sparse_degree",
    "sparse_parameters",
]

COMPLETE_UP_TO = 100  # cohorts up to this size use the complete graph
SECURITY_BITS = 40
LIVENESS_BITS = 20


def _tail(population: int, successes: int, draws: int, at_least: int) -> Fraction:
    """P[X ≥ at_least] for X ~ Hypergeometric(population, successes, draws), exactly."""
    if at_least <= 0:
        return Fraction(1)
    top = min(successes, draws)
    if at_least > top:
        return Fraction(0)
    count = sum(math.comb(successes, x) * math.comb(population - successes, draws - x) for x in range(at_least, top + 1))
    return Fraction(count, math.comb(population, draws))


def exposure_probability(n: int, colluders: int, degree: int, t_local: int) -> Fraction:
    """Union bound over the n nodes: some honest node has at least t_local colluding neighbours."""
    return min(Fraction(1), n * _tail(n - 1, colluders, degree, t_local))


def liveness_failure_probability(n: int, unavailable: int, degree: int, t_local: int) -> Fraction:
    """Union bound over the n nodes: some node has fewer than t_local honest, present neighbours."""
    helpers = n - 1 - unavailable
    return min(Fraction(1), n * (1 - _tail(n - 1, helpers, degree, t_local)))


@lru_cache(maxsize=64)
def sparse_parameters(
    n: int, colluding_fraction: float, dropout_fraction: float, *,
    security_bits: int = SECURITY_BITS, liveness_bits: int = LIVENESS_BITS,
) -> tuple[int, int] | None:
    """(k, t_local) of the cheapest sparse graph meeting both bounds for ``n`` nodes, or None when
    only the complete graph does."""
    colluders = math.floor(colluding_fraction * n)
    unavailable = colluders + math.floor(dropout_fraction * n)
    secure, live = Fraction(1, 2**security_bits), Fraction(1, 2**liveness_bits)
    for degree in range(2, n - 2, 2):
        for t_local in range(degree // 2 + 1, degree + 1):
            if exposure_probability(n, colluders, degree, t_local) > secure:
                continue
            if liveness_failure_probability(n, unavailable, degree, t_local) <= live:
                return degree, t_local
            break  # a larger t_local only makes liveness worse: try a larger degree
    return None


def sparse_degree(n: int, colluding_fraction: float, dropout_fraction: float) -> int | None:
    """The sparse graph's degree for ``n`` nodes, or None for the complete graph."""
    choice = sparse_parameters(n, colluding_fraction, dropout_fraction)
    return None if choice is None else choice[0]


def neighbour_graph(
    n: int, *, seed: bytes, complete_up_to: int = COMPLETE_UP_TO, colluding_fraction: float = 0.2,
    dropout_fraction: float = 0.1,
) -> list[frozenset[int]]:
    """Neighbours of each cohort index 0..n−1 (a node is never its own neighbour)."""
    degree = _degree(n, complete_up_to, colluding_fraction, dropout_fraction)
    if degree is None:
        return [frozenset(j for j in range(n) if j != i) for i in range(n)]
    label = _labels(n, seed)
    graph: list[set[int]] = [set() for _ in range(n)]
    for position in range(n):
        for offset in range(1, degree // 2 + 1):  # Harary graph H(degree, n): k-connected
            a, b = label[position], label[(position + offset) % n]
            graph[a].add(b)
            graph[b].add(a)
    return [frozenset(g) for g in graph]


def neighbours_of(
    index: int, n: int, *, seed: bytes, complete_up_to: int = COMPLETE_UP_TO, colluding_fraction: float = 0.2,
    dropout_fraction: float = 0.1,
) -> frozenset[int]:
    """Row ``index`` of ``neighbour_graph`` without building the other n − 1 rows: what a node needs.

    On the sparse graph the node at ring position p has the labels at p ± 1 … p ± degree/2 (the rows
    are equal to the whole graph's: tested). At 1,000 nodes this takes about 0.5 ms, the whole graph
    175 ms; a node needs its row at every stage, the coordinator the whole graph once per epoch."""
    if not 0 <= index < n:
        raise SecureAggregationError(f"cohort index {index} is outside 0..{n - 1}")
    degree = _degree(n, complete_up_to, colluding_fraction, dropout_fraction)
    if degree is None:
        return frozenset(j for j in range(n) if j != index)
    label = _labels(n, seed)
    position = label.index(index)
    return frozenset(label[(position + sign * offset) % n] for offset in range(1, degree // 2 + 1) for sign in (1, -1))


def _degree(n: int, complete_up_to: int, colluding_fraction: float, dropout_fraction: float) -> int | None:
    """The sparse graph's degree for a cohort of ``n``, or None for the complete graph."""
    if n < 2:
        raise SecureAggregationError(f"a cohort needs at least 2 nodes, got {n}")
    return None if n <= complete_up_to else sparse_degree(n, colluding_fraction, dropout_fraction)


def _labels(n: int, seed: bytes) -> list[int]:
    """The seeded ring order of the sparse graph."""
    return [int(x) for x in np.random.default_rng(int.from_bytes(seed, "big")).permutation(n)]


def share_threshold(
    threshold: int, n: int, holders: int, *, colluding_fraction: float = 0.2, dropout_fraction: float = 0.1,
) -> int:
    """Shares needed to rebuild a secret held by ``holders`` nodes of an ``n``-node cohort: the cohort
    threshold on the complete graph, the derived t_local on a sparse one."""
    if holders >= n:
        return threshold
    choice = sparse_parameters(n, colluding_fraction, dropout_fraction)
    if choice is None or choice[0] + 1 != holders:
        raise SecureAggregationError(f"{holders} share holders do not fit the sparse graph for {n} nodes")
    return choice[1]
