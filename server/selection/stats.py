"""What the server knows about each node for selection: running statistics per node, updated from
each round's outcome, and the per-node feature vectors the RL policy scores. Pure (no I/O).

A node's duration is kept per local epoch (an EMA of seconds / epochs), so a selector that also
chooses epochs can predict how long any choice will take. A late node's duration is censored: it
took at least the deadline (or, cut by over-selection, at least the time the round stopped waiting),
and that lower bound is what is recorded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.errors import SelectionError

__all__ = ["FEATURES", "NodeBook", "NodeResult", "NodeStats", "Outcome", "RoundFeedback", "features"]

EMA = 0.5  # weight of the newest observation in a node's duration and loss averages


class Outcome(StrEnum):
    OK = "ok"  # its update was aggregated
    LATE = "late"  # missed the round deadline, or was not among the first K (over-selection)
    FAILED = "failed"  # an error reply, a refused or rejected update


@dataclass(frozen=True)
class NodeResult:
    """One selected node's part in a round. ``seconds`` is its training time (None if unknown)."""

    outcome: Outcome
    epochs: int
    seconds: float | None = None
    loss: float | None = None
    samples: float | None = None
    cluster: int | None = None


@dataclass(frozen=True)
class RoundFeedback:
    """A finished round as a selector sees it: who was chosen, what each did, how long the round
    took (wall seconds, or virtual seconds in a simulation) and the global accuracy before/after."""

    round: int
    results: Mapping[int, NodeResult]
    seconds: float
    accuracy_before: float
    accuracy_after: float
    deadline: float | None = None
    loss_before: float | None = None  # the server's validation loss, when it has one
    loss_after: float | None = None


@dataclass
class NodeStats:
    samples: float = 0.0
    loss: float | None = None
    seconds_per_epoch: float | None = None
    selected: int = 0
    completed: int = 0
    late: int = 0
    failed: int = 0
    last_selected: int = 0  # round number; 0 = never
    cluster: int = 0

    @property
    def explored(self) -> bool:
        return self.selected > 0

    def failure_rate(self) -> float:
        """(late + failed) / selected with one imaginary success: a new node starts near 0, not at 0/0."""
        return (self.late + self.failed) / (self.selected + 1)

    def observe(self, number: int, result: NodeResult, deadline: float | None) -> None:
        self.selected += 1
        self.last_selected = number
        if result.samples is not None and result.samples > 0:
            self.samples = float(result.samples)
        if result.cluster is not None:
            self.cluster = int(result.cluster)
        if result.loss is not None and math.isfinite(result.loss):
            self.loss = result.loss if self.loss is None else EMA * result.loss + (1 - EMA) * self.loss
        seconds = result.seconds
        if result.outcome is Outcome.LATE and seconds is None:
            seconds = deadline  # it took at least the deadline (a cut by over-selection gives its own time)
        if seconds is not None and math.isfinite(seconds) and seconds >= 0:
            per_epoch = seconds / max(result.epochs, 1)
            self.seconds_per_epoch = (per_epoch if self.seconds_per_epoch is None
                                      else EMA * per_epoch + (1 - EMA) * self.seconds_per_epoch)
        if result.outcome is Outcome.OK:
            self.completed += 1
        elif result.outcome is Outcome.LATE:
            self.late += 1
        else:
            self.failed += 1


@dataclass
class NodeBook:
    """Statistics of every node a selector has seen, keyed by Flower node id."""

    nodes: dict[int, NodeStats] = field(default_factory=dict)
    rounds: int = 0  # rounds observed

    def get(self, node: int) -> NodeStats:
        return self.nodes.setdefault(int(node), NodeStats())

    def observe(self, feedback: RoundFeedback) -> None:
        for node, result in feedback.results.items():
            self.get(node).observe(feedback.round, result, feedback.deadline)
        self.rounds += 1

    def typical_seconds_per_epoch(self, nodes: Iterable[int]) -> float:
        """Median seconds per epoch of the given nodes that have one; 1.0 if none does."""
        known = [s.seconds_per_epoch for n in nodes if (s := self.nodes.get(int(n))) and s.seconds_per_epoch]
        return float(np.median(known)) if known else 1.0

    def to_state(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "nodes": {str(n): asdict(s) for n, s in self.nodes.items()}}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> NodeBook:
        try:
            nodes = {int(n): NodeStats(**values) for n, values in dict(state["nodes"]).items()}
            return cls(nodes=nodes, rounds=int(state["rounds"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise SelectionError(f"stored node statistics are unusable ({exc}); delete the selector state "
                                 "with 'quorumfl selection reset KEY' to start learning afresh") from exc


FEATURES = ("loss", "log-samples", "log-seconds-per-epoch", "failure-rate", "staleness", "never-selected",
            "cluster", "utility")


def features(book: NodeBook, nodes: Sequence[int], number: int, *, clusters: int = 1) -> NDArray[np.float32]:
    """One row per node (``FEATURES``), each column scaled within this round's candidates so the
    policy sees relative facts (this node is slower than most) that do not drift with the model.
    Unknown values take the candidates' median; ``never-selected`` tells the policy they were guessed."""
    stats = [book.nodes.get(int(n)) or NodeStats() for n in nodes]

    def column(values: list[float | None], *, log: bool = False) -> NDArray[np.float64]:
        known = [v for v in values if v is not None and math.isfinite(v)]
        fill = float(np.median(known)) if known else 0.0
        raw = np.array([fill if v is None or not math.isfinite(v) else v for v in values], dtype=np.float64)
        if log:
            raw = np.log(np.maximum(raw, 1e-6))
        spread = raw.std()
        return (raw - raw.mean()) / spread if spread > 1e-9 else np.zeros_like(raw)

    loss = column([s.loss for s in stats])
    samples = column([s.samples if s.samples > 0 else None for s in stats], log=True)
    speed = column([s.seconds_per_epoch for s in stats], log=True)
    utility = column([(s.samples or 1.0) * s.loss if s.loss is not None else None for s in stats], log=True)
    failure = np.array([s.failure_rate() for s in stats])
    staleness = np.array([math.log1p(max(number - s.last_selected, 0)) / math.log1p(max(number, 1)) if s.explored else 1.0
                          for s in stats])
    fresh = np.array([0.0 if s.explored else 1.0 for s in stats])
    cluster = np.array([s.cluster / max(clusters - 1, 1) for s in stats])
    return np.stack([loss, samples, speed, failure, staleness, fresh, cluster, utility], axis=1).astype(np.float32)
