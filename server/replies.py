"""Train replies from department nodes: the boundary where a remote node's message becomes an update.

``parse_train_reply`` checks a reply's structure, its size against ``max-reply-mb`` and decodes a
compressed update; ``aggregate_train_replies`` turns a round's replies into the aggregate, recording
every refused reply with its reason. Both are pure (no I/O), which is what the fuzz tests drive:
no input may raise anything but a recorded refusal, and no refused input may change the aggregate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Message
from numpy.typing import NDArray

from quorumfl.aggregation import NodeUpdate, aggregate_weighted_metrics
from quorumfl.aggregation.clustering import Repair
from quorumfl.aggregation.monitor import (
    ChangeSketch,
    RobustRule,
    UpdateStats,
    monitor_measured,
    monitor_updates,
    robust_combine,
)
from quorumfl.aggregation.weighted import BLOCK
from quorumfl.errors import QuorumError
from quorumfl.protocol.wire import (
    ARRAYS,
    COMPRESSION,
    METRICS,
    REFUSAL,
    UPDATE,
    decode_update,
    department_of,
    from_array_record,
)
from quorumfl.server.phase import TrainPhase
from quorumfl.server.strategies import AggregateResult, Strategy

__all__ = [
    "RefusedError",
    "Robust",
    "ReplyError",
    "StreamedTrain",
    "TrainReply",
    "aggregate_train_replies",
    "check_refusal",
    "combine_updates",
    "describe_repairs",
    "cluster_of_metrics",
    "parse_train_reply",
]

Arrays = dict[str, NDArray[np.generic]]


class ReplyError(QuorumError):
    """A node's reply does not follow the message contract."""


class RefusedError(ReplyError):
    """The node declined to train this round (its ε budget, or it requires DP); ``reason`` is its own."""


def check_refusal(reply: Message) -> None:
    if REFUSAL in reply.content.config_records:
        reason = reply.content.config_records[REFUSAL].get("reason", "no reason given")
        raise RefusedError(f"refused: {reason!s}")


@dataclass(frozen=True)
class TrainReply:
    node_id: int
    department: str | None
    update: NodeUpdate
    metrics: dict[str, float]

    def cluster(self, clusters: int) -> int:
        """The cluster the node says it trained (IFCA), checked against the number of clusters."""
        return cluster_of_metrics(self.metrics, clusters)


def cluster_of_metrics(metrics: dict[str, float], clusters: int) -> int:
    value = metrics.get("cluster")
    if value is None or not float(value).is_integer() or not 0 <= value < clusters:
        raise ReplyError(f"reply names cluster {value!r}; expected a whole number in 0..{clusters - 1}")
    return int(value)


def reply_bytes(reply: Message) -> int:
    return sum(len(a.data) for record in reply.content.array_records.values() for a in record.values())


def parse_train_reply(
    node_id: int, reply: Message, bases: Sequence[Arrays], *, max_reply_mb: float = 0.0, max_weight: float = 0.0,
) -> TrainReply:
    """Check a train reply's structure and decode a compressed update against the model the node was
    sent (``bases``: the global model, or the K cluster models); the arrays themselves are checked by
    the aggregator. ``max_reply_mb`` (> 0) refuses a larger payload before anything is decoded. The
    payload's size goes into the metrics as ``uplink-bytes``. ``max_weight`` (> 0) caps the example
    count a node claims, as masking does, so one node cannot outweigh the rest by its word alone."""
    content = reply.content
    check_refusal(reply)
    size = reply_bytes(reply)
    if max_reply_mb > 0 and size > max_reply_mb * 2**20:
        raise ReplyError(f"reply carries {size / 2**20:.1f} MiB of arrays, over max-reply-mb {max_reply_mb:g}")
    if ARRAYS not in content.array_records and UPDATE not in content.array_records:
        raise ReplyError("reply has no 'arrays' or 'update' record")
    if METRICS not in content.metric_records:
        raise ReplyError("reply has no 'metrics' record")
    metrics: dict[str, float] = {}
    for key, value in content.metric_records[METRICS].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[key] = float(value)
    examples = metrics.get("num-examples")
    if examples is None:
        raise ReplyError("reply metrics have no 'num-examples'")
    try:
        if ARRAYS in content.array_records:
            record = content.array_records[ARRAYS]
            arrays = from_array_record(record)
        else:
            record = content.array_records[UPDATE]
            if COMPRESSION not in content.config_records:
                raise ReplyError("a compressed reply has no 'compression' record")
            base = bases[cluster_of_metrics(metrics, len(bases))] if len(bases) > 1 else bases[0]
            delta = decode_update(record, content.config_records[COMPRESSION], {k: v.shape for k, v in base.items()})
            arrays = {k: (np.asarray(base[k], np.float32) + delta[k]).astype(base[k].dtype) for k in base}
    except ReplyError:
        raise
    except Exception as exc:  # a malformed record from a remote node must not stop the round
        raise ReplyError(f"reply arrays cannot be decoded ({exc})") from exc
    metrics["uplink-bytes"] = float(sum(len(a.data) for a in record.values()))
    weight = min(examples, max_weight) if max_weight > 0 else examples
    update = NodeUpdate(node=str(node_id), arrays=arrays, weight=weight)
    return TrainReply(node_id, department_of(content), update, metrics)


def aggregate_train_replies(
    strategy: Strategy, number: int, models: list[Arrays], replies: Sequence[tuple[int, Message]],
    failures: dict[int, tuple[str, str]], retried: dict[int, int] | None = None, *, max_reply_mb: float = 0.0,
    max_weight: float = 0.0, robust: Robust | None = None,
) -> TrainPhase:
    """Parse, validate and aggregate one round's train replies (per cluster with IFCA); every refused
    reply goes into ``failures`` as (stage, reason) and leaves the aggregate untouched. With one global
    model, the accepted updates are monitored (``update-norm``, ``update-cosine``, ``update-flagged`` in
    the node metrics) and, with a ``robust`` rule, combined by it instead of the weighted mean."""
    retried = retried or {}
    parsed: list[TrainReply] = []
    clusters: dict[int, int] = {}
    for node, reply in replies:
        try:
            item = parse_train_reply(node, reply, models, max_reply_mb=max_reply_mb, max_weight=max_weight)
            if len(models) > 1:
                clusters[node] = item.cluster(len(models))
        except ReplyError as exc:
            failures[node] = ("dp-budget" if isinstance(exc, RefusedError) else "train", str(exc))
            continue
        parsed.append(item)
    phase = TrainPhase(arrays=None)
    monitored: dict[int, UpdateStats] = {}
    if len(models) > 1:
        clustered = strategy.aggregate_clusters(number, models, ((clusters[p.node_id], p.update) for p in parsed))
        rejected, accepted_ids = clustered.rejected, clustered.accepted
        if accepted_ids:
            phase.models = clustered.models
            phase.assignments = {n: k for k, nodes in enumerate(clustered.members) for n in nodes}
            phase.repairs = describe_repairs(clustered.repairs)
        phase.total_examples = clustered.total_examples
    else:
        result, monitored = combine_updates(strategy, models[0], [p.update for p in parsed],
                                            {p.node_id: p.metrics.get("train-loss", math.nan) for p in parsed},
                                            robust or Robust())
        rejected, accepted_ids = result.rejected, result.accepted
        phase.arrays = result.arrays
        phase.total_examples = result.total_examples
    return _finish_phase(phase, parsed, accepted_ids, rejected, monitored, failures, retried)


def _finish_phase(phase: TrainPhase, parsed: Sequence[TrainReply], accepted_ids: Sequence[int],
                  rejected: Mapping[int, str], monitored: Mapping[int, UpdateStats],
                  failures: dict[int, tuple[str, str]], retried: Mapping[int, int]) -> TrainPhase:
    """The phase's nodes, metrics, flags and failures once the updates are combined."""
    for node, reason in rejected.items():
        failures[node] = ("aggregate", reason)
    accepted = [p for p in parsed if p.node_id in set(accepted_ids)]
    train_metrics = aggregate_weighted_metrics(
        (str(p.node_id), {k: v for k, v in p.metrics.items() if k != "num-examples" and math.isfinite(v)},
         p.update.weight)
        for p in accepted
    )
    phase.accepted = list(accepted_ids)
    phase.train_loss = train_metrics.get("train-loss", math.nan)
    phase.node_metrics = {p.node_id: dict(p.metrics) for p in accepted}
    phase.note_retries(retried)
    for node, stat in monitored.items():  # one global model: each accepted update, monitored
        phase.node_metrics[node].update({"update-norm": stat.norm, "update-cosine": stat.cosine,
                                         "update-flagged": float(stat.flagged)})
        if stat.flagged:
            phase.flags[node] = "; ".join(stat.reasons)
    phase.departments = {p.node_id: p.department for p in parsed}
    return phase


class StreamedTrain:
    """One global model's plaintext train stage folded as the replies arrive (``Exchange``'s
    ``consume``), for rounds without a robust rule: each reply is parsed, its change measured for
    monitoring (norm and ``ChangeSketch``), and handed to the strategy's running aggregate in batches
    of ``BLOCK``; of a reply only its metrics are kept. The server then holds the model, the running
    sums, at most ``BLOCK`` updates and one sketch per node, not every node's update."""

    def __init__(self, strategy: Strategy, reference: Arrays, failures: dict[int, tuple[str, str]], *,
                 max_reply_mb: float = 0.0, max_weight: float = 0.0) -> None:
        self.reference = reference
        self.failures = failures
        self.max_reply_mb, self.max_weight = max_reply_mb, max_weight
        self.aggregator = strategy.train_aggregator(reference)
        self.sketch = ChangeSketch({k: v for k, v in reference.items() if not k.startswith("control:")})
        self.parsed: list[TrainReply] = []
        self.measured: dict[int, tuple[float, NDArray[np.float64]]] = {}
        self.pending: list[NodeUpdate] = []

    def consume(self, node: int, reply: Message) -> None:
        try:
            item = parse_train_reply(node, reply, [self.reference], max_reply_mb=self.max_reply_mb,
                                     max_weight=self.max_weight)
        except ReplyError as exc:
            self.failures[node] = ("dp-budget" if isinstance(exc, RefusedError) else "train", str(exc))
            return
        try:
            self.measured[node] = self.sketch.measure(item.update.arrays)
        except (KeyError, ValueError):
            pass  # names or shapes differ: the aggregate refuses the update and says why
        self.pending.append(item.update)
        self.parsed.append(TrainReply(item.node_id, item.department,
                                      NodeUpdate(item.update.node, {}, item.update.weight), item.metrics))
        if len(self.pending) >= BLOCK:
            self.aggregator.add(self.pending)
            self.pending = []

    def finish(self, retried: Mapping[int, int] | None = None) -> TrainPhase:
        self.aggregator.add(self.pending)
        self.pending = []
        result = self.aggregator.finish()
        phase = TrainPhase(arrays=result.arrays, total_examples=result.total_examples)
        monitored: dict[int, UpdateStats] = {}
        if result.arrays is not None and result.accepted:
            _, mean_sketch = self.sketch.measure(result.arrays)
            losses = {p.node_id: p.metrics.get("train-loss", math.nan) for p in self.parsed}
            monitored = monitor_measured({n: self.measured[n] for n in result.accepted if n in self.measured},
                                         mean_sketch, losses)
        return _finish_phase(phase, self.parsed, result.accepted, result.rejected, monitored, self.failures,
                             retried or {})


@dataclass(frozen=True)
class Robust:
    """The run's robust-aggregation settings (``robust-aggregation``, ``robust-fraction``, ``norm-bound-factor``)."""

    rule: RobustRule = RobustRule.NONE
    fraction: float = 0.2
    norm_factor: float = 2.0


def combine_updates(strategy: Strategy, reference: Arrays, updates: Sequence[NodeUpdate], losses: Mapping[int, float],
                    robust: Robust) -> tuple[AggregateResult, dict[int, UpdateStats]]:
    """One global model's round: the strategy validates and averages the updates; then the robust rule's
    model replaces the mean (when one is set) and each accepted update is monitored: norm, cosine to the
    round's change, loss, robust z-scores (SCAFFOLD's control variates are left out of both)."""
    result = strategy.aggregate_train(reference, iter(updates))
    if result.arrays is None or not result.accepted:
        return result, {}
    kept = set(result.accepted)
    accepted = [u for u in updates if int(u.node) in kept]
    names = [k for k in reference if not k.startswith("control:")]
    if robust.rule is not RobustRule.NONE:
        combined = robust_combine(robust.rule, {k: reference[k] for k in names},
                                  [({k: u.arrays[k] for k in names}, u.weight) for u in accepted],
                                  fraction=robust.fraction, norm_factor=robust.norm_factor)
        result.arrays = {**result.arrays, **combined}
    stats = monitor_updates({k: reference[k] for k in names}, {int(u.node): {k: u.arrays[k] for k in names} for u in accepted},
                            {k: result.arrays[k] for k in names}, losses)
    return result, stats


def describe_repairs(repairs: Iterable[Repair]) -> list[str]:
    return [f"cluster {r.cluster} {r.reason}: re-seeded by splitting cluster {r.seeded_from}" for r in repairs]
