"""Strategies as small classes of hooks: which nodes train and with what, and how replies combine.

``FedAvg`` (McMahan et al., 2017) and ``FedProx`` (Li et al., 2020) share the server step — the
example-weighted mean from ``quorumfl.aggregation`` — and differ in what nodes are told: FedProx sends
the proximal coefficient μ that the node adds to its local loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import NDArray

from quorumfl.aggregation import AggregationError, NodeUpdate, WeightedMean
from quorumfl.client.wire import TrainConfig

from .config import RunConfig, StrategyName

__all__ = ["AggregateResult", "FedAvg", "FedProx", "build_strategy"]

Arrays = dict[str, NDArray[np.generic]]


@dataclass
class AggregateResult:
    """The new global arrays (None when nothing valid arrived) and why rejected nodes were rejected."""

    arrays: Arrays | None
    accepted: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    total_examples: float = 0.0


class FedAvg:
    """Sample ``fraction_train`` of the available nodes (at least ``min_nodes``); weighted mean."""

    name = StrategyName.FEDAVG

    def __init__(self, *, fraction_train: float, min_nodes: int, seed: int) -> None:
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if min_nodes < 1:
            raise ValueError(f"min_nodes must be >= 1, got {min_nodes}")
        self.fraction_train = fraction_train
        self.min_nodes = min_nodes
        self.seed = seed

    def select(self, server_round: int, available: Sequence[int]) -> list[int]:
        """Seeded sample of the available (enabled, connected) nodes for this round."""
        pool = sorted(available)
        count = min(len(pool), max(self.min_nodes, math.ceil(self.fraction_train * len(pool))))
        rng = np.random.default_rng([self.seed, server_round])
        # Sample positions, not ids: Flower's ids are uint64 and would lose precision in a float array.
        return sorted(pool[int(i)] for i in rng.choice(len(pool), size=count, replace=False))

    def configure_train(self, server_round: int, nodes: Iterable[int], base: TrainConfig) -> dict[int, TrainConfig]:
        config = replace(base, server_round=server_round, proximal_mu=0.0)
        return {node: config for node in nodes}

    def aggregate_train(self, template: Arrays, updates: Iterable[NodeUpdate]) -> AggregateResult:
        """Weighted mean of the valid updates; an invalid update is rejected, never averaged."""
        mean = WeightedMean(template)
        result = AggregateResult(arrays=None)
        for update in updates:
            try:
                mean.add(update)
            except AggregationError as exc:
                result.rejected[int(update.node)] = str(exc)
            else:
                result.accepted.append(int(update.node))
        if result.accepted:
            result.arrays = mean.result()
            result.total_examples = mean.total_weight
        return result


class FedProx(FedAvg):
    """FedAvg whose nodes minimise ``loss + μ/2 · ||w − w_global||²``."""

    name = StrategyName.FEDPROX

    def __init__(self, *, fraction_train: float, min_nodes: int, seed: int, proximal_mu: float) -> None:
        super().__init__(fraction_train=fraction_train, min_nodes=min_nodes, seed=seed)
        if not proximal_mu >= 0.0:
            raise ValueError(f"proximal_mu must be >= 0, got {proximal_mu}")
        self.proximal_mu = proximal_mu

    def configure_train(self, server_round: int, nodes: Iterable[int], base: TrainConfig) -> dict[int, TrainConfig]:
        config = replace(base, server_round=server_round, proximal_mu=self.proximal_mu)
        return {node: config for node in nodes}


def build_strategy(config: RunConfig) -> FedAvg:
    """The strategy named by the run config, with every hyperparameter visible here."""
    if config.strategy is StrategyName.FEDPROX:
        return FedProx(
            fraction_train=config.fraction_train, min_nodes=config.min_nodes, seed=config.seed,
            proximal_mu=config.proximal_mu,
        )
    return FedAvg(fraction_train=config.fraction_train, min_nodes=config.min_nodes, seed=config.seed)
