"""Pure combination math for QuorumFL: no I/O, no logging, no Flower imports."""

from .clustering import ClusteredMean, choose_cluster, cluster_purity, repair_clusters
from .errors import AggregationError, EmptyAggregationError, QuorumError
from .weighted import NodeUpdate, WeightedMean, aggregate_weighted_mean, aggregate_weighted_metrics

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
