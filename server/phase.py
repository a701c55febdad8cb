"""What the train phase of a round produced, whichever way it was aggregated (plaintext or masked),
and who failed in the round."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.app import RecordDict
from numpy.typing import NDArray

from quorumfl.aggregation.monitor import histogram_flags
from quorumfl.aggregation.secagg import SecureMean, flatten, unflatten
from quorumfl.aggregation.secagg.payload import LOSS_EDGES, NORM_EDGES
from quorumfl.protocol.wire import CLEAR_METRICS, METRICS, array_bytes, department_of

__all__ = ["RoundOutcome", "TrainPhase", "cluster_groups"]


@dataclass
class RoundOutcome:
    participants: list[int] = field(default_factory=list)
    failures: dict[int, tuple[str, str]] = field(default_factory=dict)  # node -> (stage, reason)


@dataclass
class TrainPhase:
    """New global arrays (None if the round produced none), who is in them, and per-node facts.

    Clustered rounds fill ``models`` (all K, unchanged where no update arrived) instead of ``arrays``.

    ``node_metrics`` are what nodes reported in plaintext (in masked mode only their training time).
    ``error`` says why no arrays were produced when the reason is not per-node.
    """

    arrays: dict[str, NDArray[np.generic]] | None
    accepted: list[int] = field(default_factory=list)
    total_examples: float = 0.0
    train_loss: float = float("nan")
    # secure rounds: the weighted means of what the nodes measured with the model they received
    # (primary metric in the objective's unit, loss), revealed only as sums like the update
    eval_value: float = float("nan")
    eval_loss: float = float("nan")
    node_metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    departments: dict[int, str | None] = field(default_factory=dict)
    error: str | None = None
    flags: dict[int, str] = field(default_factory=dict)  # plaintext: nodes whose update stood out, and why
    # secure rounds: nodes per update-norm bucket and per train-loss bucket, summed over the groups
    norm_histogram: list[float] = field(default_factory=list)
    loss_histogram: list[float] = field(default_factory=list)
    # Clustered runs (IFCA): every cluster's model after the round, and each accepted node's cluster.
    models: list[dict[str, NDArray[np.generic]]] | None = None
    assignments: dict[int, int] = field(default_factory=dict)
    repairs: list[str] = field(default_factory=list)

    def apply_group_means(self, models: list[dict[str, NDArray[np.generic]]], means: dict[int, tuple[list[int], SecureMean]],
                          *, clustered: bool, max_weight: float) -> None:
        """A secure round's revealed group means (cluster → (members, mean)) as the round's result: each
        group's model moved by its mean update, who is in it, the examples (the weights were divided by
        ``max_weight`` on the nodes), the weighted train loss and the weighted evaluation of the received
        model, and the groups' norm and loss histograms added up. Groups not in ``means`` keep their model."""
        new_models = [dict(m) for m in models]
        weight, loss_sum, value_sum, eval_loss_sum = 0.0, 0.0, 0.0, 0.0
        for k, (members, mean) in sorted(means.items()):
            new_models[k] = unflatten(flatten(models[k]) + mean.update, models[k])
            self.accepted.extend(members)
            self.assignments.update({n: k for n in members})
            weight += mean.total_weight
            loss_sum += mean.train_loss * mean.total_weight
            value_sum += mean.eval_value * mean.total_weight
            eval_loss_sum += mean.eval_loss * mean.total_weight
            for mine, theirs in ((self.norm_histogram, mean.norm_histogram), (self.loss_histogram, mean.loss_histogram)):
                if theirs:
                    mine[:] = [a + b for a, b in zip(mine or [0.0] * len(theirs), theirs, strict=True)]
        self.accepted.sort()
        if clustered:
            self.models = new_models
        else:
            self.arrays = new_models[0]
            self.assignments = {}
        self.total_examples = weight * max_weight
        self.train_loss = loss_sum / weight if weight else float("nan")
        self.eval_value = value_sum / weight if weight else float("nan")
        self.eval_loss = eval_loss_sum / weight if weight else float("nan")

    def monitoring(self) -> tuple[dict[str, float], list[str]]:
        """The round's monitoring figures and what stood out: in plaintext, the flagged nodes (from
        ``aggregation.monitor.monitor_updates``); in secure rounds, the revealed norm and loss histograms
        (non-empty buckets as ``norm-histogram-NN``/``loss-histogram-NN``) and how many nodes stand out."""
        if any("update-flagged" in m for m in self.node_metrics.values()):
            notes = [f"node {node}'s update stands out: {why}" for node, why in self.flags.items()]
            return {"flagged-nodes": float(len(self.flags))}, notes
        if not self.norm_histogram:
            return {}, []
        count, reasons = histogram_flags(self.norm_histogram, self.loss_histogram,
                                         edges=(NORM_EDGES.tolist(), LOSS_EDGES.tolist()))
        figures = {"flagged-nodes": float(count)}
        for name, histogram in (("norm", self.norm_histogram), ("loss", self.loss_histogram)):
            figures.update({f"{name}-histogram-{i:02d}": c for i, c in enumerate(histogram) if c})
        return figures, [f"the secure sum's histograms: {r}" for r in reasons]

    def note_node(self, node: int, content: RecordDict) -> None:
        """Keep what a secure-mode reply says in plaintext (``CLEAR_METRICS``: training time, ε spent
        and budget), its department and the size of the arrays it sent (``uplink-bytes``)."""
        metrics = content.metric_records.get(METRICS)
        noted = self.node_metrics.setdefault(node, {})
        for key in CLEAR_METRICS:
            value = metrics.get(key) if metrics is not None else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                noted[key] = float(value)
        noted["uplink-bytes"] = float(array_bytes(content))
        self.departments[node] = department_of(content)

    def note_retries(self, retried: Mapping[int, int]) -> None:
        """The node metric ``train-retries`` for each node whose input arrived after its ClientApp
        crashed and it was asked again."""
        for node, times in retried.items():
            if node in self.node_metrics:
                self.node_metrics[node]["train-retries"] = float(times)


def cluster_groups(nodes: Iterable[int], cluster_of: Mapping[int, int], fewest: int,
                   failures: dict[int, tuple[str, str]]) -> dict[int, list[int]]:
    """Secure rounds with IFCA: ``nodes`` by the cluster each chose, one group each. A cluster of fewer
    than ``fewest`` nodes sits the round out (its nodes recorded at stage ``secagg-group``): its sum
    would expose too few updates."""
    members: dict[int, list[int]] = {}
    for n in sorted(nodes):
        if n in cluster_of:
            members.setdefault(cluster_of[n], []).append(n)
    for k, group in list(members.items()):
        if len(group) < fewest:
            for n in group:
                failures[n] = ("secagg-group", f"cluster {k} has {len(group)} node(s), below the group minimum "
                                               f"{fewest}; its sum would expose too few updates")
            del members[k]
    return members
