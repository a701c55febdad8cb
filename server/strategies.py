"""Strategies as small classes of hooks: which nodes train and with what, and how replies combine.

``FedAvg`` (McMahan et al., 2017) and ``FedProx`` (Li et al., 2020) share the server step — the
example-weighted mean from ``quorumfl.aggregation`` — and differ in what nodes are told: FedProx sends
the proximal coefficient μ that the node adds to its local loss. ``FedPer`` and ``Ditto`` are FedProx
on the server (μ = 0 makes them FedAvg) and tell nodes how to personalise (``client.node_round``);
FedPer's server model holds only the shared layers. ``ClusteredFedAvg`` (IFCA) keeps K models: nodes
report which one fits them and each cluster is averaged on its own, then empty or collapsed
clusters are re-seeded (``aggregation.clustering``).

Every strategy answers the ``Strategy`` protocol, so the round loop, the round modes and the reply
parser ask the strategy instead of checking its class: which arrays the server holds and evaluates,
the model-version lineages, what each node is told, and how updates (per cluster) combine.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from quorumfl.aggregation import AggregationError, NodeUpdate, WeightedMean
from quorumfl.aggregation.clustering import ClusteredMean, Repair, repair_clusters
from quorumfl.aggregation.personal import personal_names, split_arrays
from quorumfl.core.models import CONTROL_PREFIX, split_control
from quorumfl.protocol.wire import TrainConfig
from quorumfl.server.config import RunConfig, StrategyName

__all__ = [
    "AggregateResult", "ClusteredFedAvg", "ClusteredResult", "Ditto", "FedAvg", "FedPer", "FedProx", "Scaffold", "Strategy",
    "build_strategy",
]

Arrays = dict[str, NDArray[np.generic]]


@dataclass
class AggregateResult:
    """The new global arrays (None when nothing valid arrived) and why rejected nodes were rejected."""

    arrays: Arrays | None
    accepted: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    total_examples: float = 0.0


@dataclass
class ClusteredResult:
    """The K cluster models after a round, who went where, and what was repaired."""

    models: list[Arrays]
    members: list[list[int]]
    accepted: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    updated: list[int] = field(default_factory=list)  # clusters that received updates this round
    repairs: list[Repair] = field(default_factory=list)
    total_examples: float = 0.0


class TrainAggregator:
    """A round's weighted mean fed in parts (``add``), as a streamed round hands over its replies; an
    invalid update is rejected, never averaged. Holds the running sums only."""

    def __init__(self, template: Arrays) -> None:
        self.mean = WeightedMean(template)
        self.rejected: dict[int, str] = {}

    def add(self, updates: Iterable[NodeUpdate]) -> None:
        self.rejected.update({int(node): reason for node, reason in self.mean.extend(updates).items()})

    def finish(self) -> AggregateResult:
        result = AggregateResult(arrays=None, rejected=dict(self.rejected),
                                 accepted=[int(node) for node in self.mean.nodes])
        if result.accepted:
            result.arrays = self.mean.result()
            result.total_examples = self.mean.total_weight
        return result


class Strategy(Protocol):
    """What the federation loop asks of a strategy (FedAvg, FedProx, FedPer, Ditto, IFCA)."""

    name: StrategyName
    clusters: int  # server models: 1, or IFCA's K

    def count(self, available: int) -> int:
        """How many nodes a round aggregates."""
        ...

    def server_arrays(self, full: Arrays) -> Arrays:
        """The part of a full model that the server holds and sends."""
        ...

    def lineages(self, architecture: str) -> list[str]:
        """The model-version lineage of each server model (one per cluster)."""
        ...

    def evaluates_on_server(self) -> bool:
        """Whether the server's models can be evaluated on the server's held-out set."""
        ...

    def configure_train(self, server_round: int, nodes: Iterable[int], base: TrainConfig) -> dict[int, TrainConfig]:
        """What each selected node is told for this round."""
        ...

    def aggregate_train(self, template: Arrays, updates: Iterable[NodeUpdate]) -> AggregateResult:
        """One server model: the combination of the valid updates."""
        ...

    def train_aggregator(self, template: Arrays) -> TrainAggregator:
        """``aggregate_train`` fed in parts, as replies arrive (running sums)."""
        ...

    def aggregate_clusters(
        self, server_round: int, models: Sequence[Arrays], updates: Iterable[tuple[int, NodeUpdate]]
    ) -> ClusteredResult:
        """Several server models: each combined from the updates of the nodes that chose it."""
        ...

    def repair(self, server_round: int, result: ClusteredResult) -> ClusteredResult:
        """After a round's per-cluster sums: re-seed clusters that emptied or collapsed."""
        ...


class FedAvg:
    """``fraction_train`` of the available nodes (at least ``min_nodes``) train, chosen by the run's
    selector (``server.selection``); weighted mean."""

    name = StrategyName.FEDAVG
    clusters = 1

    def server_arrays(self, full: Arrays) -> Arrays:
        """The part of a full model that the server holds and sends (all of it, except for FedPer)."""
        return dict(full)

    def __init__(self, *, fraction_train: float, min_nodes: int, seed: int) -> None:
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if min_nodes < 1:
            raise ValueError(f"min_nodes must be >= 1, got {min_nodes}")
        self.fraction_train = fraction_train
        self.min_nodes = min_nodes
        self.seed = seed

    def count(self, available: int) -> int:
        """How many nodes a round aggregates: ``fraction_train`` of the available, at least ``min_nodes``."""
        return min(available, max(self.min_nodes, math.ceil(self.fraction_train * available)))

    def lineages(self, architecture: str) -> list[str]:
        """The architecture itself: heads and rollbacks then never mix incompatible arrays."""
        return [architecture]

    def evaluates_on_server(self) -> bool:
        return True

    def configure_train(self, server_round: int, nodes: Iterable[int], base: TrainConfig) -> dict[int, TrainConfig]:
        config = replace(base, server_round=server_round, proximal_mu=0.0)
        return {node: config for node in nodes}

    def aggregate_train(self, template: Arrays, updates: Iterable[NodeUpdate]) -> AggregateResult:
        """Weighted mean of the valid updates; an invalid update is rejected, never averaged."""
        aggregator = self.train_aggregator(template)
        aggregator.add(updates)
        return aggregator.finish()

    def train_aggregator(self, template: Arrays) -> TrainAggregator:
        return TrainAggregator(template)

    def aggregate_clusters(
        self, server_round: int, models: Sequence[Arrays], updates: Iterable[tuple[int, NodeUpdate]]
    ) -> ClusteredResult:
        """Per-cluster weighted means of the valid updates; a cluster without updates keeps its model;
        then empty and collapsed clusters are re-seeded from the largest one."""
        if len(models) != self.clusters:
            raise AggregationError(f"{len(models)} cluster models, the strategy has {self.clusters}")
        mean = ClusteredMean(models)
        result = ClusteredResult(models=[dict(m) for m in models], members=[[] for _ in models])
        for cluster, update in updates:
            try:
                mean.add(cluster, update)
            except AggregationError as exc:
                result.rejected[int(update.node)] = str(exc)
            else:
                result.accepted.append(int(update.node))
                result.members[cluster].append(int(update.node))
        if result.accepted:
            for k, arrays in mean.results().items():
                result.models[k] = arrays
                result.updated.append(k)
            result.total_examples = mean.total_weight
        return self.repair(server_round, result)

    def repair(self, server_round: int, result: ClusteredResult) -> ClusteredResult:
        """Nothing to repair with one model."""
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


class FedPer(FedProx):
    """Shared layers are averaged; the personal ones (``personal_layers``) never leave the nodes."""

    name = StrategyName.FEDPER

    def __init__(self, *, fraction_train: float, min_nodes: int, seed: int, proximal_mu: float,
                 personal_layers: str) -> None:
        super().__init__(fraction_train=fraction_train, min_nodes=min_nodes, seed=seed, proximal_mu=proximal_mu)
        if not personal_layers.strip():
            raise ValueError("FedPer needs personal-layers (layer prefixes, or 'head')")
        self.personal_layers = personal_layers

    def server_arrays(self, full: Arrays) -> Arrays:
        shared: Arrays = split_arrays(full, personal_names(list(full), self.personal_layers))[0]
        return shared

    def lineages(self, architecture: str) -> list[str]:
        """Its shared layers' own lineage (the server holds no head)."""
        layers = self.personal_layers.replace(" ", "")
        if len(architecture) + len(layers) > 100:  # the DB column holds 128 characters
            layers = hashlib.sha256(layers.encode()).hexdigest()[:16]
        return [f"{architecture}|fedper-shared:{layers}"]

    def evaluates_on_server(self) -> bool:
        return False  # the server's model has no head: the departments evaluate it

    def configure_train(self, server_round: int, nodes: Iterable[int], base: TrainConfig) -> dict[int, TrainConfig]:
        config = replace(base, server_round=server_round, proximal_mu=self.proximal_mu, personalisation="fedper",
                         personal_layers=self.personal_layers)
        return {node: config for node in nodes}


class Ditto(FedProx):
    """FedAvg (or FedProx) for the global model; each node also keeps a personal model pulled towards
    the global one by ``λ/2 · ||v − w||²`` (Li et al., 2021)."""

    name = StrategyName.DITTO

    def __init__(self, *, fraction_train: float, min_nodes: int, seed: int, proximal_mu: float,
                 ditto_lambda: float) -> None:
        super().__init__(fraction_train=fraction_train, min_nodes=min_nodes, seed=seed, proximal_mu=proximal_mu)
        if not ditto_lambda >= 0.0:
            raise ValueError(f"ditto_lambda must be >= 0, got {ditto_lambda}")
        self.ditto_lambda = ditto_lambda

    def configure_train(self, server_round: int, nodes: Iterable[int], base: TrainConfig) -> dict[int, TrainConfig]:
        config = replace(base, server_round=server_round, proximal_mu=self.proximal_mu, personalisation="ditto",
                         ditto_lambda=self.ditto_lambda)
        return {node: config for node in nodes}


class Scaffold(FedAvg):
    """SCAFFOLD (Karimireddy et al., 2020): the server keeps a control variate c (one array per model
    array, under ``control:`` names beside the model's own, starting at zero) and each node its own
    c_i; nodes step along g − c_i + c and send back the trained model and c + Δc_i. The example-weighted
    mean of what comes back is the new model and the new c (full participation: c + mean Δc_i; the
    server step size is 1). The control arrays travel, are summed under masking or CKKS and are stored
    with the model version; evaluation and export use the model's own arrays."""

    name = StrategyName.SCAFFOLD

    def server_arrays(self, full: Arrays) -> Arrays:
        model, control = split_control(full)
        if not control:
            control = {name: np.zeros_like(value, dtype=np.float32) for name, value in model.items()}
        return {**model, **{CONTROL_PREFIX + name: value for name, value in control.items()}}

    def lineages(self, architecture: str) -> list[str]:
        """Its own lineage: its versions carry control arrays a plain model's do not."""
        return [f"{architecture}|scaffold"]

    def configure_train(self, server_round: int, nodes: Iterable[int], base: TrainConfig) -> dict[int, TrainConfig]:
        config = replace(base, server_round=server_round, proximal_mu=0.0, personalisation="scaffold")
        return {node: config for node in nodes}


class ClusteredFedAvg(FedProx):
    """IFCA (Ghosh et al., 2020): K cluster models; each node trains the one with the lowest loss on
    its own data and reports only its index; each cluster is averaged over its own nodes."""

    name = StrategyName.IFCA

    def __init__(self, *, fraction_train: float, min_nodes: int, seed: int, proximal_mu: float, clusters: int,
                 merge_distance: float, reseed_noise: float) -> None:
        super().__init__(fraction_train=fraction_train, min_nodes=min_nodes, seed=seed, proximal_mu=proximal_mu)
        if clusters < 1:
            raise ValueError(f"clusters must be >= 1, got {clusters}")
        if merge_distance < 0 or reseed_noise < 0:
            raise ValueError("merge_distance and reseed_noise must be >= 0")
        self.clusters = clusters
        self.merge_distance = merge_distance
        self.reseed_noise = reseed_noise

    def lineages(self, architecture: str) -> list[str]:
        if self.clusters == 1:
            return [architecture]
        return [f"{architecture}|ifca-{self.clusters}:cluster-{k}" for k in range(self.clusters)]

    def repair(self, server_round: int, result: ClusteredResult) -> ClusteredResult:
        """Re-seed empty and collapsed clusters (only once some cluster has members)."""
        counts = [len(m) for m in result.members]
        if self.clusters > 1 and any(counts):
            rng = np.random.default_rng([self.seed, server_round, 7])
            result.models, result.repairs = repair_clusters(
                result.models, counts, merge_distance=self.merge_distance, noise=self.reseed_noise, rng=rng
            )
        return result


def build_strategy(config: RunConfig) -> Strategy:
    """The strategy named by the run config, with every hyperparameter visible here."""
    fraction, least, seed, mu = config.fraction_train, config.min_nodes, config.seed, config.proximal_mu
    if config.strategy is StrategyName.FEDPROX:
        return FedProx(fraction_train=fraction, min_nodes=least, seed=seed, proximal_mu=mu)
    if config.strategy is StrategyName.FEDPER:
        return FedPer(fraction_train=fraction, min_nodes=least, seed=seed, proximal_mu=mu,
                      personal_layers=config.personal_layers)
    if config.strategy is StrategyName.DITTO:
        return Ditto(fraction_train=fraction, min_nodes=least, seed=seed, proximal_mu=mu,
                     ditto_lambda=config.ditto_lambda)
    if config.strategy is StrategyName.SCAFFOLD:
        return Scaffold(fraction_train=fraction, min_nodes=least, seed=seed)
    if config.strategy is StrategyName.IFCA:
        return ClusteredFedAvg(fraction_train=fraction, min_nodes=least, seed=seed, proximal_mu=mu,
                               clusters=config.clusters, merge_distance=config.ifca_merge_distance,
                               reseed_noise=config.ifca_reseed_noise)
    return FedAvg(fraction_train=fraction, min_nodes=least, seed=seed)
