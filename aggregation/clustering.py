"""IFCA cluster math (Ghosh et al. 2020): pick the cluster by lowest local loss, per-cluster running means,
repair of empty and collapsed clusters, and purity against planted groups.

A node evaluates the K cluster models on its own data and reports only the index of the best one
(``choose_cluster``); the server aggregates each cluster's updates separately (``ClusteredMean``,
one running weighted mean per cluster — or, under secure aggregation, one masked or encrypted sum
per group). Pure: no I/O, no logging.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from quorumfl.aggregation.weighted import NodeUpdate, WeightedMean
from quorumfl.errors import AggregationError, EmptyAggregationError

__all__ = ["ClusteredMean", "Repair", "choose_cluster", "cluster_purity", "repair_clusters"]

Arrays = Mapping[str, NDArray[np.generic]]


def choose_cluster(losses: Sequence[float]) -> int:
    """Index of the lowest finite loss (the first one on ties); the node's IFCA assignment."""
    finite = [(loss, k) for k, loss in enumerate(losses) if isinstance(loss, (int, float)) and math.isfinite(loss)]
    if not finite:
        raise AggregationError(f"no cluster model has a finite loss on this node's data ({list(losses)})")
    return min(finite)[1]


class ClusteredMean:
    """One running weighted mean per cluster; a rejected update leaves every cluster untouched."""

    def __init__(self, templates: Sequence[Arrays]) -> None:
        if not templates:
            raise AggregationError("clustered aggregation needs at least one cluster model")
        self._means = [WeightedMean(t) for t in templates]

    @property
    def clusters(self) -> int:
        return len(self._means)

    def add(self, cluster: int, update: NodeUpdate) -> None:
        if isinstance(cluster, bool) or not isinstance(cluster, int) or not 0 <= cluster < len(self._means):
            raise AggregationError(f"cluster id {cluster!r} is not in 0..{len(self._means) - 1}", node=update.node)
        self._means[cluster].add(update)

    @property
    def total_weight(self) -> float:
        return sum(m.total_weight for m in self._means)

    def members(self) -> list[list[str]]:
        """Accepted nodes per cluster."""
        return [m.nodes for m in self._means]

    def results(self) -> dict[int, dict[str, NDArray[np.generic]]]:
        """The weighted mean of each cluster that received at least one update."""
        out = {k: m.result() for k, m in enumerate(self._means) if m.nodes}
        if not out:
            raise EmptyAggregationError("no cluster received a valid update")
        return out


@dataclass(frozen=True)
class Repair:
    cluster: int
    reason: str  # "empty" or "collapsed into cluster N"
    seeded_from: int


def _flat(arrays: Arrays) -> NDArray[np.float64]:
    return np.concatenate([np.asarray(arrays[k], dtype=np.float64).ravel() for k in sorted(arrays)])


def repair_clusters(
    models: Sequence[Arrays],
    members: Sequence[int],
    *,
    merge_distance: float,
    noise: float,
    rng: np.random.Generator,
) -> tuple[list[dict[str, NDArray[np.generic]]], list[Repair]]:
    """Re-seed clusters that are empty or have collapsed onto another one, by splitting the largest.

    A cluster with no members this round, or whose model lies within ``merge_distance`` (relative L2)
    of a larger cluster's model, is re-seeded by splitting the largest cluster (as k-means' LBG
    splitting does): it becomes the largest model plus a Gaussian perturbation δ of ``noise`` × that
    model's per-tensor std, and the largest becomes the model minus δ (for the first re-seeded cluster).
    Neither half is then systematically worse on the nodes' data, so the nodes divide between them
    instead of all staying with an unperturbed model. Returns the new models and what was repaired.
    """
    if len(models) != len(members) or not models:
        raise AggregationError(f"{len(models)} cluster models but {len(members)} member counts")
    if merge_distance < 0 or noise < 0:
        raise AggregationError("merge_distance and noise must be non-negative")
    out = [{k: np.array(v, copy=True) for k, v in m.items()} for m in models]
    largest = max(range(len(models)), key=lambda k: (members[k], -k))
    flats = [_flat(m) for m in models]
    repairs: list[Repair] = []
    for k in range(len(models)):
        if k == largest:
            continue
        reason = None
        if members[k] == 0:
            reason = "empty"
        else:
            for j in range(len(models)):
                if j == k or (members[j], -j) < (members[k], -k):
                    continue  # only collapse into a larger (or equal and earlier) cluster
                scale = max(float(np.linalg.norm(flats[j])), 1e-12)
                if float(np.linalg.norm(flats[k] - flats[j])) / scale <= merge_distance:
                    reason = f"collapsed into cluster {j}"
                    break
        if reason is None:
            continue
        plus: dict[str, NDArray[np.generic]] = {}
        minus: dict[str, NDArray[np.generic]] = {}
        for name in sorted(models[largest]):  # sorted: the noise must not depend on the arrays' order
            arr = np.asarray(models[largest][name])
            std = float(np.std(arr.astype(np.float64))) if arr.size else 0.0
            delta = rng.normal(0.0, noise * std, size=arr.shape) if std > 0 else np.zeros(arr.shape)
            plus[name] = (arr.astype(np.float64) + delta).astype(arr.dtype)
            minus[name] = (arr.astype(np.float64) - delta).astype(arr.dtype)
        out[k] = plus
        if not repairs:
            out[largest] = minus
        repairs.append(Repair(k, reason, largest))
    return out, repairs


def cluster_purity(assigned: Sequence[int], planted: Sequence[int]) -> float:
    """Share of nodes whose cluster's most common planted group is their own (1.0 = perfect recovery)."""
    if len(assigned) != len(planted) or not assigned:
        raise AggregationError(f"{len(assigned)} assignments for {len(planted)} planted groups")
    correct = 0
    for cluster in set(assigned):
        groups = [g for a, g in zip(assigned, planted, strict=True) if a == cluster]
        correct += max(groups.count(g) for g in set(groups))
    return correct / len(assigned)
