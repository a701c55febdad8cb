"""Pure combination math for QuorumFL: no I/O, no logging, no Flower imports.

The names below are loaded on first use (PEP 562), so importing ``quorumfl.errors`` —
which every command of the CLI does — does not import numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from quorumfl.errors import AggregationError, EmptyAggregationError, QuorumError

if TYPE_CHECKING:
    from quorumfl.aggregation.clustering import (
        ClusteredMean,
        choose_cluster,
        cluster_purity,
        repair_clusters,
    )
    from quorumfl.aggregation.weighted import (
        NodeUpdate,
        WeightedMean,
        aggregate_weighted_mean,
        aggregate_weighted_metrics,
    )

__all__ = [
    "AggregationError",
    "ClusteredMean",
    "EmptyAggregationError",
    "NodeUpdate",
    "QuorumError",
    "WeightedMean",
    "aggregate_weighted_mean",
    "aggregate_weighted_metrics",
    "choose_cluster",
    "cluster_purity",
    "repair_clusters",
]

_LAZY = {
    "ClusteredMean": "clustering", "choose_cluster": "clustering", "cluster_purity": "clustering",
    "repair_clusters": "clustering", "NodeUpdate": "weighted", "WeightedMean": "weighted",
    "aggregate_weighted_mean": "weighted", "aggregate_weighted_metrics": "weighted",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
