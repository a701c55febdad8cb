"""Round modes: how a round's updates are combined — in plaintext, masked, or under threshold CKKS.

A mode runs the train phase of one round for the nodes the strategy configured (``configs``: one
train config per selected node) and returns a ``TrainPhase``: the new model(s), who is in them and
what the nodes reported. The federation loop (``rounds.py``) does not branch on the mode; a new
secure mode is a class here and a line in ``build_mode``.

- ``PlaintextMode``: each update is validated and joins the strategy's running means (``replies.py``);
- ``MaskingMode``: pairwise masking with Shamir t-of-n (``secure.py``);
- ``CkksMode``: threshold CKKS (``ckks.py``); its key ceremonies and decryptions are recorded in the
  state DB as they happen.

With IFCA, both secure modes first ask every selected node which cluster model fits its data (one
round trip), then sum (and reveal) each cluster as a group of its own; the strategy repairs empty
or merged clusters.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
from flwr.app import MessageType
from numpy.typing import NDArray

from quorumfl.aggregation.monitor import RobustRule
from quorumfl.errors import FederationError
from quorumfl.protocol.wire import METRICS, TrainConfig, department_of
from quorumfl.server.ckks import AuditTrail, CkksSession
from quorumfl.server.config import RunConfig, SecureMode
from quorumfl.server.exchange import Exchange, requests
from quorumfl.server.phase import RoundOutcome, TrainPhase
from quorumfl.server.replies import (
    ReplyError,
    Robust,
    StreamedTrain,
    aggregate_train_replies,
    cluster_of_metrics,
    describe_repairs,
)
from quorumfl.server.secure import MaskingSession
from quorumfl.server.state.repository import Repository
from quorumfl.server.strategies import ClusteredResult, Strategy

__all__ = ["IFCA_PICK", "CkksMode", "MaskingMode", "PlaintextMode", "RoundMode", "build_mode"]

log = logging.getLogger(__name__)
IFCA_PICK = "query.ifca_pick"
Arrays = dict[str, NDArray[np.generic]]


class RoundMode(Protocol):
    """The train phase of one round, whichever way updates are combined."""

    def start(self, run_id: int) -> None:
        """The run's state-DB id is known (before its first round)."""

    def train(
        self, number: int, available: Sequence[int], models: list[Arrays], configs: dict[int, TrainConfig],
        outcome: RoundOutcome, timings: dict[str, float],
    ) -> TrainPhase:
        """Send ``configs``' nodes the model(s), combine their updates; failures go to ``outcome``."""
        ...


class PlaintextMode:
    """Train round trip with plaintext updates; each is validated, then averaged (per cluster)."""

    def __init__(self, config: RunConfig, strategy: Strategy, exchange: Exchange,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config, self.strategy, self.exchange, self.clock = config, strategy, exchange, clock

    def start(self, run_id: int) -> None:
        pass

    def train(
        self, number: int, available: Sequence[int], models: list[Arrays], configs: dict[int, TrainConfig],
        outcome: RoundOutcome, timings: dict[str, float],
    ) -> TrainPhase:
        """Train round trip with plaintext updates; each update is validated, then averaged (per cluster)."""
        start = self.clock()
        messages = requests(MessageType.TRAIN, models, configs)
        retried: dict[int, int] = {}
        if len(models) == 1 and self.config.robust_aggregation == RobustRule.NONE:
            # Folded as the replies arrive: the server never holds every node's update.
            streamed = StreamedTrain(self.strategy, models[0], outcome.failures,
                                     max_reply_mb=self.config.max_reply_mb, max_weight=self.config.secagg_max_weight)
            self.exchange(messages, outcome.failures, "train", self.config.train_deadline(), consume=streamed.consume,
                          retries=self.config.train_retries, retried=retried)
            timings["train"] = self.clock() - start
            start = self.clock()
            phase = streamed.finish(retried)
            timings["aggregate"] = self.clock() - start
            return phase
        replies = self.exchange(messages, outcome.failures, "train", self.config.train_deadline(),
                                 retries=self.config.train_retries, retried=retried)
        timings["train"] = self.clock() - start

        start = self.clock()
        phase = aggregate_train_replies(self.strategy, number, models, replies, outcome.failures, retried,
                                        max_reply_mb=self.config.max_reply_mb,
                                        max_weight=self.config.secagg_max_weight,
                                        robust=Robust(self.config.robust_aggregation, self.config.robust_fraction,
                                                      self.config.norm_bound_factor))
        timings["aggregate"] = self.clock() - start
        return phase


class _SecureMode(ABC):
    """What the secure modes share: with IFCA (several server models) every selected node first says
    which cluster model fits its data (one round trip), then each cluster is one group whose sum
    alone is revealed, and the strategy repairs empty or merged clusters."""

    config: RunConfig
    strategy: Strategy
    exchange: Exchange
    clock: Callable[[], float]

    @abstractmethod
    def _sums(
        self, number: int, available: Sequence[int], models: list[Arrays], configs: dict[int, TrainConfig],
        outcome: RoundOutcome, timings: dict[str, float], cluster_of: Mapping[int, int] | None,
    ) -> TrainPhase:
        """The mode's own sums: one group, or one per cluster of ``cluster_of``."""

    def start(self, run_id: int) -> None:  # noqa: B027  (most modes need nothing at the run's start)
        return None

    def train(
        self, number: int, available: Sequence[int], models: list[Arrays], configs: dict[int, TrainConfig],
        outcome: RoundOutcome, timings: dict[str, float],
    ) -> TrainPhase:
        if len(models) == 1:
            return self._sums(number, available, models, configs, outcome, timings, None)
        chosen, departments = self._pick(models, configs, outcome, timings)
        phase = self._sums(number, available, models, {n: c for n, c in configs.items() if n in chosen}, outcome,
                           timings, chosen)
        phase.departments = {**departments, **phase.departments}
        if phase.models is not None:
            members = [[n for n, c in phase.assignments.items() if c == k] for k in range(len(models))]
            repaired = self.strategy.repair(number, ClusteredResult(models=phase.models, members=members))
            phase.models = repaired.models
            phase.repairs = describe_repairs(repaired.repairs)
        return phase

    def _pick(
        self, models: list[Arrays], configs: dict[int, TrainConfig], outcome: RoundOutcome, timings: dict[str, float]
    ) -> tuple[dict[int, int], dict[int, str | None]]:
        """IFCA before a secure round: every selected node says which cluster model fits its data."""
        start = self.clock()
        replies = self.exchange(requests(IFCA_PICK, models, configs), outcome.failures, "ifca-pick",
                                 self.config.round_timeout)
        chosen: dict[int, int] = {}
        departments: dict[int, str | None] = {}
        for node, reply in replies:
            record = reply.content.metric_records.get(METRICS)
            values = {k: float(v) for k, v in (record or {}).items() if isinstance(v, (int, float))}
            try:
                chosen[node] = cluster_of_metrics(values, len(models))
            except ReplyError as exc:
                outcome.failures[node] = ("ifca-pick", str(exc))
                continue
            departments[node] = department_of(reply.content)
        timings["ifca-pick"] = self.clock() - start
        return chosen, departments


class MaskingMode(_SecureMode):
    """Masked rounds (``MaskingSession``); with IFCA one masked sum per cluster."""

    def __init__(self, config: RunConfig, strategy: Strategy, exchange: Exchange,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config, self.strategy, self.exchange, self.clock = config, strategy, exchange, clock
        self.secure = MaskingSession(config, exchange, clock=clock)

    def _sums(
        self, number: int, available: Sequence[int], models: list[Arrays], configs: dict[int, TrainConfig],
        outcome: RoundOutcome, timings: dict[str, float], cluster_of: Mapping[int, int] | None,
    ) -> TrainPhase:
        return self.secure.round(models, configs, outcome.failures, timings, cluster_of=cluster_of)


class CkksMode(_SecureMode):
    """Threshold-CKKS rounds (``CkksSession``), with the run's ceremonies and decryptions recorded;
    with IFCA one encrypted sum, and one decryption, per cluster."""

    def __init__(self, config: RunConfig, strategy: Strategy, exchange: Exchange, repo: Repository, *,
                 flower_run_id: int | None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.config, self.strategy, self.exchange, self.repo, self.clock = config, strategy, exchange, repo, clock
        self.flower_run_id = flower_run_id
        self.session: CkksSession | None = None

    def start(self, run_id: int) -> None:
        self.session = CkksSession(self.config, self.exchange, run_id=self.flower_run_id or 0,
                                   audit=_RepoAudit(self.repo, self.exchange, run_id), clock=self.clock)

    def _sums(
        self, number: int, available: Sequence[int], models: list[Arrays], configs: dict[int, TrainConfig],
        outcome: RoundOutcome, timings: dict[str, float], cluster_of: Mapping[int, int] | None,
    ) -> TrainPhase:
        if self.session is None:
            raise FederationError("a CKKS round before its run started")
        return self.session.round(number, available, models, configs, outcome.failures, timings,
                                  cluster_of=cluster_of)


class _RepoAudit(AuditTrail):
    """Key ceremonies and decryptions of a run, recorded in the state DB as they happen."""

    def __init__(self, repo: Repository, exchange: Exchange, run_id: int) -> None:
        self.repo = repo
        self.exchange = exchange  # its running round is the one a decryption belongs to
        self.run_id = run_id

    def ceremony_requested(self) -> bool:
        return self.repo.ceremony_requested(self.run_id)

    def ceremony_started(self, members: Sequence[int], threshold: int, params: dict[str, object]) -> int:
        return self.repo.start_ceremony(self.run_id, members=members, threshold=threshold, params=params)

    def ceremony_finished(self, ceremony: int, *, key_id: str | None, holders: Sequence[int], error: str | None) -> None:
        self.repo.finish_ceremony(ceremony, key_id=key_id, holders=holders, error=error)

    def decryption_started(self, *, key_id: str, contributors: Sequence[int], decryptors: Sequence[int]) -> int:
        round_id = self.exchange.round_id
        if round_id is None:
            raise FederationError("a decryption outside a round")
        return self.repo.add_decryption(round_id, key_id=key_id, contributors=contributors, decryptors=decryptors)

    def decryption_finished(self, decryption: int, *, error: str | None) -> None:
        self.repo.finish_decryption(decryption, error=error)


def build_mode(config: RunConfig, strategy: Strategy, exchange: Exchange, repo: Repository, *,
               flower_run_id: int | None, clock: Callable[[], float] = time.perf_counter) -> RoundMode:
    """The run's round mode, from ``secure-aggregation``."""
    if config.secure_aggregation is SecureMode.MASKING:
        return MaskingMode(config, strategy, exchange, clock)
    if config.secure_aggregation is SecureMode.CKKS:
        return CkksMode(config, strategy, exchange, repo, flower_run_id=flower_run_id, clock=clock)
    return PlaintextMode(config, strategy, exchange, clock)
