"""Pure combination math for QuorumFL: no I/O, no logging, no Flower imports."""

from .errors import AggregationError, EmptyAggregationError, QuorumError
from .weighted import NodeUpdate, WeightedMean, aggregate_weighted_mean, aggregate_weighted_metrics

__all__ = [
    "AggregationError",
    "EmptyAggregationError",
    "NodeUpdate",
    "QuorumError",
    "WeightedMean",
    "aggregate_weighted_mean",
    "aggregate_weighted_metrics",
]
