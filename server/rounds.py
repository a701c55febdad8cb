"""The federation loop on Flower's Grid: select → train → validate & aggregate → evaluate → store.

Each phase is timed and recorded in the state DB as it happens, so ``quorumfl runs show`` can follow
a run live and a crash loses at most the round in flight. A node whose reply is an error, malformed,
late or rejected by aggregation is recorded as a round failure and the round goes on without it.
"""

from __future__ import annotations

import hashlib
import logging
import math
import resource
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from numpy.typing import NDArray

from quorumfl.aggregation.compression import warmup_fraction
from quorumfl.aggregation.secagg.identity import Roster, department_message
from quorumfl.core.data.datasets import Dataset, holdout_split
from quorumfl.core.models import architecture_key, arrays_to_model, build_model, model_to_arrays
from quorumfl.errors import (
    ConfigError,
    FederationError,
    RunStoppedError,
    SecureAggregationError,
    StateError,
)
from quorumfl.protocol.wire import (
    ARRAYS,
    CONFIG,
    METRICS,
    NODE,
    TrainConfig,
    cluster_key,
    department_of,
    to_array_record,
)
from quorumfl.server.ckks import AuditTrail, CkksSession
from quorumfl.server.config import DpMode, RunConfig, SecureMode, StartFrom
from quorumfl.server.model_store import ModelStore
from quorumfl.server.phase import TrainPhase
from quorumfl.server.pulling import ReplyPuller
from quorumfl.server.replies import (
    ReplyError,
    aggregate_train_replies,
    cluster_of_metrics,
    describe_repairs,
    parse_train_reply,
)
from quorumfl.server.secure import MaskingSession
from quorumfl.server.selection import (
    NodeResult,
    Outcome,
    RoundFeedback,
    Selection,
    Selector,
    build_selector,
    check_selection,
)
from quorumfl.server.state.orm import Run
from quorumfl.server.state.repository import INTERRUPTED, Repository, RoundStatus, RunStatus
from quorumfl.server.strategies import (
    ClusteredFedAvg,
    ClusteredResult,
    FedAvg,
    FedPer,
    build_strategy,
)
from quorumfl.training.local import evaluate

__all__ = ["IFCA_PICK", "Federation", "ReplyError", "parse_train_reply"]

log = logging.getLogger(__name__)
REPLY_POLL_SECONDS = 0.1  # how often the ServerApp asks the SuperLink for replies
IFCA_PICK = "query.ifca_pick"
Arrays = dict[str, NDArray[np.generic]]


def distributed_noise(config: RunConfig) -> float | None:
    """Distributed DP: σ of the Gaussian mechanism on each revealed sum, for the run's target ε over its
    rounds with q = fraction-train (or the configured σ); None in the other modes."""
    if config.dp is not DpMode.DISTRIBUTED:
        return None
    from quorumfl.privacy.accounting import noise_for_target

    sigma = config.dp_noise_multiplier or noise_for_target(config.dp_epsilon, config.dp_delta, config.fraction_train,
                                                           config.num_rounds)
    log.info("distributed DP: noise multiplier %.3f on each revealed sum (clip %s)", sigma, config.dp_clip)
    return sigma


@dataclass
class RoundOutcome:
    participants: list[int] = field(default_factory=list)
    failures: dict[int, tuple[str, str]] = field(default_factory=dict)  # node -> (stage, reason)


class Federation:
    """One run of the federation loop against a Flower Grid."""

    def __init__(
        self,
        grid: Grid,
        config: RunConfig,
        repo: Repository,
        store: ModelStore,
        *,
        flower_run_id: int | None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.grid = grid
        self.config = config
        self.repo = repo
        self.store = store
        self.flower_run_id = flower_run_id
        self.clock = clock
        self.roster = Roster.from_json(config.roster) if config.roster else None
        self.strategy: FedAvg = build_strategy(config)
        self.secure: MaskingSession | None = (
            MaskingSession(config, self._exchange, clock=clock) if config.secure_aggregation is SecureMode.MASKING else None
        )
        self.dp_noise = distributed_noise(config)  # distributed DP: σ on each revealed sum, else None
        # the settings a node takes as they are (declared node=True in server/config.py), plus what the
        # server decides: the round, μ (the strategy's, per node) and distributed DP's σ
        self._base = TrainConfig(
            server_round=0, proximal_mu=0.0, dp_noise_multiplier=self.dp_noise or config.dp_noise_multiplier,
            **config.node_settings(),
        )
        self._last_round_id: int | None = None
        self._progress_written = -math.inf  # clock of the last progress write
        self.progress_interval = 1.0  # seconds between progress writes within a stage
        self.ckks: CkksSession | None = None
        self.selector: Selector = build_selector(config.selector, seed=config.seed, epochs=config.local_epochs,
                                                 epoch_choices=config.epoch_choices(), clusters=config.clusters)
        self._accuracy = math.nan  # the global (main cluster's) accuracy after the last round
        self._loss = math.nan  # and its validation loss
        self._quota: int | None = None  # over-selection: the train stage stops after this many good replies
        self._arrivals: dict[int, float] = {}  # seconds from sending the train request to each reply
        self._cut_at: float | None = None  # when the train stage stopped waiting for the over-selected
        self._stray: list[tuple[int, str]] = []  # replies this round refused as answering no request

    # ---- helpers ----------------------------------------------------------------------------
    def _federation_epsilon(self, rounds: int) -> float:
        from quorumfl.privacy.accounting import epsilon

        assert self.dp_noise is not None
        return float(epsilon([(self.dp_noise, self.config.fraction_train, rounds)], self.config.dp_delta))

    def _compression_round(self, number: int) -> TrainConfig:
        """This round's compression: random-k coordinates from a per-round seed (the same for every
        node), every ``compression-sync-every``-th round a full-precision sync, and top-k's share
        of entries during its warm-up (``compression-warmup-rounds``)."""
        every = self.config.compression_sync_every
        seed = int.from_bytes(hashlib.sha256(f"{self.config.seed}:{number}".encode()).digest()[:4], "big")
        fraction = warmup_fraction(self.config.compression_fraction, number, self.config.compression_warmup_rounds)
        return replace(self._base, compression_seed=seed, compression_full=bool(every) and number % every == 0,
                       compression_fraction=fraction)

    def _lineages(self, arch: str) -> list[str]:
        """The model-version lineage of each server model: the architecture, or a cluster of it, or
        its shared layers (FedPer), so heads and rollbacks never mix incompatible arrays."""
        strategy = self.strategy
        if isinstance(strategy, FedPer):
            layers = strategy.personal_layers.replace(" ", "")
            if len(arch) + len(layers) > 100:  # the DB column holds 128 characters
                layers = hashlib.sha256(layers.encode()).hexdigest()[:16]
            return [f"{arch}|fedper-shared:{layers}"]
        if strategy.clusters > 1:
            return [f"{arch}|ifca-{strategy.clusters}:cluster-{k}" for k in range(strategy.clusters)]
        return [arch]

    def _initial(self, test: Dataset) -> tuple[list[str], list[Arrays], list[int | None]]:
        arch = architecture_key(self.config.model, test.input_shape, test.num_classes)
        lineages = self._lineages(arch)
        models: list[Arrays] = []
        parents: list[int | None] = []
        for k, lineage in enumerate(lineages):
            head = self.repo.head_version(lineage) if self.config.start_from is StartFrom.HEAD else None
            if head is not None:
                log.info("starting from model version %s (head of %s)", head.id, lineage)
                models.append(self.store.load(head.path, head.sha256))
                parents.append(head.id)
                continue
            # IFCA's clusters start from different seeds, so they can tell departments apart.
            model = build_model(self.config.model, test.input_shape, test.num_classes, seed=self.config.seed + k)
            models.append(self.strategy.server_arrays(model_to_arrays(model)))
            parents.append(None)
        return lineages, models, parents

    def _available_nodes(self) -> list[int]:
        """Connected, enabled nodes; waits up to ``node-wait-timeout`` for ``min-nodes`` of them."""
        deadline = self.clock() + self.config.node_wait_timeout
        while True:
            disabled = self.repo.disabled_node_ids()
            nodes = [int(n) for n in self.grid.get_node_ids() if int(n) not in disabled]
            if len(nodes) >= self.config.min_nodes or self.clock() >= deadline:
                break
            time.sleep(1.0)
        if len(nodes) < self.config.min_nodes:
            raise FederationError(
                f"only {len(nodes)} enabled node(s) connected after {self.config.node_wait_timeout:.0f}s, "
                f"min-nodes is {self.config.min_nodes}; start more nodes or lower min-nodes"
            )
        return nodes

    def _messages(self, kind: str, models: Sequence[Arrays], configs: dict[int, TrainConfig]) -> list[Message]:
        """One request per node carrying the model (or every cluster model, as ``cluster-k``)."""
        if len(models) == 1:
            records = {ARRAYS: to_array_record(models[0])}
        else:
            records = {cluster_key(k): to_array_record(m) for k, m in enumerate(models)}
        return [
            Message(
                content=RecordDict({**records, CONFIG: cfg.to_record()}),
                dst_node_id=node,
                message_type=kind,
            )
            for node, cfg in configs.items()
        ]

    def _name_from_roster(self, node: int, reply: Message) -> None:
        """In a signed federation a reply's department is the roster name its node key signed for this
        run and node; an unsigned or mis-signed claim is dropped (the node then has no name), so a node
        cannot pass itself off as another department."""
        roster = self.roster
        if roster is None or NODE not in reply.content.config_records:
            return
        record = reply.content.config_records[NODE]
        claimed, signature = record.get("department"), record.get("department-signature")
        try:
            if not isinstance(claimed, str) or not isinstance(signature, bytes):
                raise SecureAggregationError("the reply's department is not signed")
            binding = b"run:" + str(self.flower_run_id or 0).encode()
            roster.check(claimed, department_message(binding=binding, node=node, department=claimed), signature, node=node)
        except SecureAggregationError as exc:
            log.warning("node %s: department %r not taken (%s)", node, claimed, exc)
            reply.content.config_records[NODE] = ConfigRecord({"department": ""})

    def _exchange(
        self,
        messages: list[Message],
        failures: dict[int, tuple[str, str]],
        stage: str,
        timeout: float,
        consume: Callable[[int, Message], None] | None = None,
        retries: int = 0,
        retried: dict[int, int] | None = None,
    ) -> list[tuple[int, Message]]:
        """Send, wait up to ``timeout`` seconds, and record error replies and missing nodes.

        Replies are matched to requests by ``reply_to_message_id``: an error reply that the SuperLink
        writes for an unreachable node carries the SuperLink's own id as its source. With ``consume``
        each good reply is handed over as soon as it is pulled and not kept (a running sum then
        holds one aggregate, not every node's reply); without it the good replies are returned.

        A node whose ClientApp crashed (Flower's ``CLIENT_APP_CRASHED``: killed, out of memory) is
        sent the same request again, up to ``retries`` times while the deadline allows; the same
        job resumes from the node's training checkpoint. ``retried`` counts the re-sends per node.
        Other errors (the app raised, the node is gone) are final: asking again would fail again.
        """
        expected = {int(m.metadata.dst_node_id) for m in messages}
        request = {int(m.metadata.dst_node_id): m for m in messages}
        message_ids = list(self.grid.push_messages(messages))  # Flower sends an object shared by messages once
        destination = {mid: int(m.metadata.dst_node_id) for mid, m in zip(message_ids, messages, strict=True)}
        good: list[tuple[int, Message]] = []
        attempts: dict[int, int] = retried if retried is not None else {}
        again: list[int] = []
        train = stage == "train"
        quota = self._quota if train else None
        received = 0
        started = self.clock()
        asked = len(expected)
        since = time.time()

        def report(*, force: bool = False) -> None:
            waiting_nodes = len(expected)
            self._report_progress({
                "stage": stage, "asked": asked, "replied": received,
                "failed": asked - waiting_nodes - received, "waiting": waiting_nodes,
                "started": round(since, 3), "deadline": round(since + timeout, 3),
            }, force=force)

        report(force=True)

        def take(reply: Message) -> None:
            node = destination.get(reply.metadata.reply_to_message_id)
            if node is None or node not in expected:
                reason = "reply answers no open request of this stage (replayed, duplicated or unsolicited)"
                log.warning("refusing a reply from node %s: %s", reply.metadata.src_node_id, reason)
                self._stray.append((int(reply.metadata.src_node_id), f"{stage}: {reason}"))
                return
            if (reply.has_error() and reply.error.code == ErrorCode.CLIENT_APP_CRASHED
                    and attempts.get(node, 0) < retries and self.clock() < deadline):
                attempts[node] = attempts.get(node, 0) + 1
                log.warning("node %s: its ClientApp crashed during %s (%s); asking again (%d of %d)",
                            node, stage, reply.error.reason, attempts[node], retries)
                again.append(node)
                return
            expected.discard(node)
            if reply.has_error():
                failures[node] = (stage, f"node error {reply.error.code}: {reply.error.reason}"
                                  + (f" (after {attempts[node]} retries)" if attempts.get(node) else ""))
            elif reply.metadata.src_node_id != node:
                failures[node] = (stage, f"reply came from node {reply.metadata.src_node_id}, not {node}")
            else:
                self._name_from_roster(node, reply)
                nonlocal received
                received += 1
                if train:
                    self._arrivals[node] = self.clock() - started
                if consume is not None:
                    consume(node, reply)
                else:
                    good.append((node, reply))

        # Grid.send_and_receive sleeps 3 s between pulls; every round trip would pay up to that again.
        # ``ReplyPuller`` lists the arrived replies in one request per poll and pulls each one's objects
        # on a few threads: a reply whose arrays are still uploading over a slow link then holds up
        # neither the others nor the deadline.
        waiting = set(message_ids)
        deadline = self.clock() + timeout
        with ReplyPuller(self.grid) as puller:
            while waiting:
                pulled = puller.poll(sorted(waiting))
                for reply in pulled:
                    waiting.discard(reply.metadata.reply_to_message_id)
                    if quota is None or received < quota:  # a reply after the cut leaves its node late
                        take(reply)
                if pulled:
                    report()
                if again:
                    copies = [Message(content=request[n].content, dst_node_id=n,
                                      message_type=request[n].metadata.message_type) for n in again]
                    for mid, node in zip(self.grid.push_messages(copies), again, strict=True):
                        destination[mid] = node
                        waiting.add(mid)
                    again.clear()
                if quota is not None and received >= quota:
                    self._cut_at = self.clock() - started
                    for node in expected:  # over-selection: the first ``quota`` replies are the round's
                        failures[node] = ("late", f"not among the first {quota} replies (over-selection); "
                                                  f"the round stopped waiting after {self._cut_at:.1f}s")
                    return good
                if not waiting or self.clock() >= deadline:
                    break
                time.sleep(REPLY_POLL_SECONDS)
        for node in expected:
            if train and self.config.round_deadline:
                failures[node] = ("deadline", f"no reply within the round deadline ({timeout:.0f}s)")
            else:
                failures[node] = (stage, f"no reply within the {stage} deadline ({timeout:.0f}s)")
        return good

    def _report_progress(self, progress: dict[str, Any], *, force: bool) -> None:
        """Record the running round's stage for `runs start --follow` and the demo (at most once per
        ``progress_interval``, except at a stage's start). Only a display: a failed write is logged,
        not raised."""
        now = self.clock()
        if self._last_round_id is None or (not force and now - self._progress_written < self.progress_interval):
            return
        self._progress_written = now
        try:
            self.repo.set_round_progress(self._last_round_id, progress)
        except StateError as exc:
            log.warning("could not record the round's progress: %s", exc)

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, *, on_round: Callable[[int, dict[str, float]], None] | None = None) -> int:
        """Run all rounds; returns the QuorumFL run id. The run is marked failed on any error.
        With ``resume-run``, an interrupted run continues after its last finished round."""
        config = self.config
        if config.resume_run:
            run = self._take_up(config.resume_run)
        else:
            run = self.repo.create_run(
                flower_run_id=self.flower_run_id,
                config=config.resolved(),
                strategy=config.strategy.value,
                num_rounds=config.num_rounds,
            )
        if config.secure_aggregation is SecureMode.CKKS:
            self.ckks = CkksSession(config, self._exchange, run_id=self.flower_run_id or 0,
                                    audit=_RepoAudit(self, run.id), clock=self.clock)
        try:
            _, test = holdout_split(config.dataset, seed=config.seed, data_dir=config.data_path())
            lineages, models, parents = self._initial(test)
            first, completed, seen = 1, 0, set[int]()
            if config.resume_run:
                first, completed, seen = self._resume_point(run, lineages, models, parents)
            model = build_model(config.model, test.input_shape, test.num_classes)
            self._restore_selector()
            self._accuracy, self._loss = self._server_evaluation(model, models[0], test)
            for number in range(first, config.num_rounds + 1):
                if self.repo.run_status(run.id) is RunStatus.STOPPED:
                    log.info("run %s was stopped by the admin before round %s", run.id, number)
                    return run.id
                for k, lineage in enumerate(lineages):
                    head = self.repo.head_version(lineage)
                    if parents[k] is not None and head is not None and head.id != parents[k]:
                        log.info("head of %s moved to version %s (rollback); continuing from it", lineage, head.id)
                        models[k], parents[k] = self.store.load(head.path, head.sha256), head.id
                models, parents, metrics = self._round(run.id, number, lineages, models, parents, model, test, seen)
                completed += bool(metrics)
                if on_round is not None:
                    on_round(number, metrics)
            if completed == 0:
                raise FederationError(
                    f"none of the {config.num_rounds} round(s) completed; 'quorumfl rounds list' shows why"
                )
            self._final_evaluation(run.id, models, sorted(seen))
        except RunStoppedError as exc:
            # An admin's 'runs stop' was recorded while this ServerApp was between rounds (Flower ends
            # it soon after): the run stays stopped, and no round is left running.
            self.repo.abort_running_rounds(run.id, "run stopped by the admin")
            log.warning("run %s: %s", run.id, exc)
            return run.id
        except (SystemExit, KeyboardInterrupt):
            # Flower ends a ServerApp this way when its server stops (Ctrl-C of 'quorumfl server start':
            # the parent process is gone) or its run is stopped at the SuperLink. Not a failure of the
            # run: it stays running (an admin's 'runs stop' has recorded it as stopped already) and the
            # next 'server start' resumes it, as after a crash.
            self.repo.abort_running_rounds(run.id, INTERRUPTED)
            log.warning("run %s interrupted: the ServerApp was stopped; 'quorumfl server start' resumes it", run.id)
            raise
        except BaseException as exc:
            reason = f"{exc.__class__.__name__}: {exc}"
            self.repo.abort_running_rounds(run.id, reason)
            self.repo.finish_run(run.id, RunStatus.FAILED, error=reason)
            raise
        self.repo.finish_run(run.id, RunStatus.COMPLETED)
        return run.id

    # ---- resuming an interrupted run -----------------------------------------------------------
    def _take_up(self, run_id: int) -> Run:
        """The interrupted run, checked against this config (the same run, not a look-alike)."""
        stored = self.repo.get_run(run_id)
        ignored = {"resume-run", "node-state-key", "roster"}  # the roster is the admin's current one
        mine = {k: v for k, v in self.config.resolved().items() if k not in ignored}
        theirs = {k: v for k, v in stored.config.items() if k not in ignored}
        # Keys a newer release added are absent from an older run's stored config: they keep their defaults.
        differ = sorted(k for k in theirs if mine.get(k) != theirs[k])
        if differ:
            raise ConfigError(f"resume-run {run_id}: this config differs from the run's stored config in {differ}; "
                              f"resume it with 'quorumfl runs resume {run_id}', which sends the stored config")
        run = self.repo.resume_run(run_id, flower_run_id=self.flower_run_id,
                                   reason=INTERRUPTED)
        log.info("resuming run %s as Flower run %s", run_id, self.flower_run_id)
        return run

    def _resume_point(self, run: Run, lineages: list[str], models: list[Arrays],
                      parents: list[int | None]) -> tuple[int, int, set[int]]:
        """Load the models of the last completed round into ``models``/``parents``; returns the first
        round to run, the rounds completed so far and the nodes that took part in them."""
        rounds = self.repo.list_rounds(run.id)
        finished = [r for r in rounds if r.status in (RoundStatus.COMPLETED, RoundStatus.FAILED)]
        done = [r for r in finished if r.status == RoundStatus.COMPLETED]
        seen = {int(n) for r in done for n in r.participants}
        if done:
            last = max(r.number for r in done)
            versions = [v for v in self.repo.list_model_versions(run_id=run.id) if v.round == last]
            for k, lineage in enumerate(lineages):
                matching = [v for v in versions if v.architecture == lineage]
                if not matching:
                    raise FederationError(f"run {run.id}: round {last} completed but has no stored model version for "
                                          f"{lineage}; it cannot be resumed")
                version = matching[-1]
                models[k], parents[k] = self.store.load(version.path, version.sha256), version.id
        first = max((r.number for r in finished), default=0) + 1
        log.info("run %s resumes at round %s after %s completed round(s)", run.id, first, len(done))
        return first, len(done), seen

    def _round(
        self,
        run_id: int,
        number: int,
        lineages: list[str],
        models: list[Arrays],
        parents: list[int | None],
        model: Any,
        test: Dataset,
        seen: set[int],
    ) -> tuple[list[Arrays], list[int | None], dict[str, float]]:
        config = self.config
        available = self._available_nodes()
        for node in available:  # registry: connected nodes, named once they reply
            self.repo.touch_node(node)
        selection = self._select(available)
        selected = sorted(selection.nodes)
        rnd = self.repo.start_round(run_id, number, selected)
        self._last_round_id = rnd.id
        outcome = RoundOutcome()
        timings: dict[str, float] = {}

        configs = {node: replace(cfg, local_epochs=selection.epochs[node]) for node, cfg in
                   self.strategy.configure_train(number, selected, self._compression_round(number)).items()}
        if self.ckks is not None:
            phase = self.ckks.round(number, available, models[0], configs, outcome.failures, timings)
        elif self.secure is not None and len(models) > 1:
            phase = self._masked_clustered_phase(number, models, configs, outcome, timings)
        elif self.secure is not None:
            phase = self.secure.round(models, configs, outcome.failures, timings)
        else:
            phase = self._plaintext_phase(number, models, configs, outcome, timings)
        for node in phase.accepted:
            self.repo.touch_node(node, department=phase.departments.get(node))
            seen.add(node)
        timings["local_train_max"] = max(
            (phase.node_metrics.get(n, {}).get("train-seconds", 0.0) for n in phase.accepted), default=0.0
        )

        for node, (stage, reason) in outcome.failures.items():
            self.repo.add_failure(rnd.id, node, stage=stage, reason=reason)
            log.warning("round %s: node %s failed at %s: %s", number, node, stage, reason)
        for node, reason in self._stray:
            self.repo.add_failure(rnd.id, node, stage="rejected", reason=reason)
        self._stray = []

        new_models = phase.models if phase.models is not None else ([phase.arrays] if phase.arrays is not None else None)
        if new_models is None or len(phase.accepted) < config.min_nodes:
            why = phase.error or (
                f"{len(phase.accepted)} valid update(s) of {len(selected)} selected; min-nodes is {config.min_nodes}"
            )
            self.repo.finish_round(rnd.id, RoundStatus.FAILED, participants=phase.accepted, timings=timings, error=why)
            log.warning("round %s failed: %s; the global model is unchanged", number, why)
            self._learn_selection(run_id, number, selection, phase, outcome, timings, self._accuracy, self._loss)
            return models, parents, {}

        start = self.clock()
        members = [sum(1 for c in phase.assignments.values() if c == k) for k in range(len(new_models))]
        evals = [self._server_evaluation(model, arrays, test) for arrays in new_models]
        main = max(range(len(new_models)), key=lambda k: (members[k], -k))  # the cluster serving the most nodes
        timings["evaluate"] = self.clock() - start
        round_metrics = {
            "accuracy": evals[main][0],
            "loss": evals[main][1],
            "train-loss": phase.train_loss,
            "participants": float(len(phase.accepted)),
            "examples": phase.total_examples,
            # Peak RSS of the ServerApp process so far (Linux reports KiB).
            "server-peak-rss-mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        }
        if self.dp_noise is not None:  # distributed DP: the federation's ε after this many rounds
            round_metrics["dp-federation-epsilon"] = self._federation_epsilon(number)
        if len(new_models) > 1:
            round_metrics["clusters-repaired"] = float(len(phase.repairs))
            for k in range(len(new_models)):
                round_metrics[f"accuracy-cluster-{k}"] = evals[k][0]
                round_metrics[f"nodes-cluster-{k}"] = float(members[k])
            for repair in phase.repairs:
                log.info("round %s: %s", number, repair)

        start = self.clock()
        versions: list[int | None] = []
        for k, arrays in enumerate(new_models):
            suffix = f"-cluster{k}" if len(new_models) > 1 else ""
            stored = self.store.save(arrays, f"run{run_id}-round{number:04d}{suffix}")
            version_metrics = {"accuracy": evals[k][0], "loss": evals[k][1]}
            if len(new_models) > 1:
                version_metrics.update({"cluster": float(k), "nodes": float(members[k])})
            version = self.repo.add_model_version(
                run_id=run_id,
                round_number=number,
                parent_id=parents[k],
                architecture=lineages[k],
                path=str(stored.path),
                sha256=stored.sha256,
                size_bytes=stored.size_bytes,
                metrics={n: v for n, v in version_metrics.items() if math.isfinite(v)},
            )
            versions.append(version.id)
        self.repo.add_metrics(run_id, number, {k: v for k, v in round_metrics.items() if math.isfinite(v)})
        for node in phase.accepted:
            values = dict(phase.node_metrics.get(node, {}))
            if node in phase.assignments:
                values["cluster"] = float(phase.assignments[node])  # the round's cluster assignment
            if values:
                self.repo.add_metrics(run_id, number, values, node_id=node)
        timings["store"] = self.clock() - start
        self.repo.finish_round(rnd.id, RoundStatus.COMPLETED, participants=phase.accepted, timings=timings)
        self._learn_selection(run_id, number, selection, phase, outcome, timings, evals[main][0], evals[main][1])
        log.info(
            "round %s/%s: accuracy %.4f, %s of %s nodes, %.1fs",
            number, config.num_rounds, evals[main][0], len(phase.accepted), len(selected), sum(timings.values()),
        )
        return new_models, versions, round_metrics

    # ---- client selection --------------------------------------------------------------------
    def _restore_selector(self) -> None:
        """Continue from the selector state kept under the run's selection key (a restarted server)."""
        key = self.config.resolved_selection_key()
        row = self.repo.selector_state(key) if self.selector.name != "random" else None  # random learns nothing
        if row is None:
            return
        if row.kind != self.selector.name:
            raise ConfigError(f"selection-key {key!r} holds a '{row.kind}' selector's state, this run uses "
                              f"'{self.selector.name}'; choose another selection-key")
        self.selector.restore(row.state)
        log.info("selector '%s' continues from %s learned round(s) (key %s)", row.kind, row.rounds, key)

    def _selection_step(self) -> int:
        """The selector's own round count (+1): run round numbers restart with each run, while a kept
        selector's statistics ("last chosen in round t") continue across runs."""
        return self.selector.book.rounds + 1

    def _select(self, available: list[int]) -> Selection:
        """K nodes from the selector (K·(1 + over-selection) asked for), checked against its contract."""
        count = self.strategy.count(len(available))
        asked = min(len(available), count + math.ceil(count * self.config.over_selection))
        selection = self.selector.select(self._selection_step(), available, asked)
        check_selection(selection, available, asked, self.config.epoch_choices())
        self._quota = count if asked > count else None
        self._arrivals, self._cut_at = {}, None
        return selection

    def _learn_selection(self, run_id: int, number: int, selection: Selection, phase: TrainPhase,
                         outcome: RoundOutcome, timings: dict[str, float], accuracy: float, loss: float) -> None:
        """Tell the selector how the round went, record its choice and reward, keep its state."""
        results: dict[int, NodeResult] = {}
        for node in selection.nodes:
            epochs = selection.epochs[node]
            if node in phase.accepted:
                values = phase.node_metrics.get(node, {})
                results[node] = NodeResult(
                    Outcome.OK, epochs, seconds=self._arrivals.get(node, values.get("train-seconds")),
                    loss=values.get("train-loss"), samples=values.get("num-examples"),
                    cluster=phase.assignments.get(node),
                )
                continue
            stage = outcome.failures.get(node, ("", ""))[0]
            if stage == "late":
                results[node] = NodeResult(Outcome.LATE, epochs, seconds=self._cut_at)
            elif stage == "deadline":
                results[node] = NodeResult(Outcome.LATE, epochs)
            else:
                results[node] = NodeResult(Outcome.FAILED, epochs)
        before = self._accuracy if math.isfinite(self._accuracy) else accuracy
        after = accuracy if math.isfinite(accuracy) else before
        seconds = sum(v for k, v in timings.items() if k != "local_train_max")
        feedback = RoundFeedback(self._selection_step(), results, seconds, before if math.isfinite(before) else 0.0,
                                 after if math.isfinite(after) else 0.0,
                                 deadline=self.config.round_deadline or None, loss_before=self._loss,
                                 loss_after=loss if math.isfinite(loss) else self._loss)
        reward = self.selector.observe(feedback)
        self._accuracy, self._loss = after, feedback.loss_after if feedback.loss_after is not None else math.nan
        details = {"round-seconds": seconds, "accuracy-gain": feedback.accuracy_after - feedback.accuracy_before}
        if feedback.loss_before is not None and feedback.loss_after is not None:
            details["loss-fall"] = feedback.loss_before - feedback.loss_after
        guard = getattr(self.selector, "guard", None)
        if guard is not None:
            details.update({k: v for k, v in (("agent-avg", guard.agent_avg), ("heuristic-avg", guard.heuristic_avg))
                            if v is not None})
        self.repo.add_selection(run_id, number, policy=selection.policy,
                                choices=[(n, selection.epochs[n]) for n in selection.nodes],
                                outcomes={n: r.outcome.value for n, r in results.items()}, reward=reward,
                                details=details)
        if self.selector.name != "random":
            self.repo.save_selector_state(self.config.resolved_selection_key(), kind=self.selector.name,
                                          rounds=self.selector.book.rounds, state=self.selector.state())

    def _server_evaluation(self, model: Any, arrays: Arrays, test: Dataset) -> tuple[float, float]:
        """(accuracy, loss) on the server's held-out set; NaN for FedPer, whose server model has no head."""
        if isinstance(self.strategy, FedPer):
            return math.nan, math.nan
        arrays_to_model(model, arrays)
        result = evaluate(model, test)
        return result.accuracy, result.loss

    def _pick(
        self, models: list[Arrays], configs: dict[int, TrainConfig], outcome: RoundOutcome, timings: dict[str, float]
    ) -> tuple[dict[int, int], dict[int, str | None]]:
        """IFCA before a masked round: every selected node says which cluster model fits its data."""
        start = self.clock()
        replies = self._exchange(self._messages(IFCA_PICK, models, configs), outcome.failures, "ifca-pick",
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

    def _masked_clustered_phase(
        self, number: int, models: list[Arrays], configs: dict[int, TrainConfig], outcome: RoundOutcome,
        timings: dict[str, float],
    ) -> TrainPhase:
        """IFCA with masking: the choice first (one round trip), then one masked sum per cluster."""
        if self.secure is None or not isinstance(self.strategy, ClusteredFedAvg):
            raise FederationError("a masked clustered round needs masking and the ifca strategy")
        chosen, departments = self._pick(models, configs, outcome, timings)
        phase = self.secure.round(models, {n: c for n, c in configs.items() if n in chosen}, outcome.failures,
                                  timings, cluster_of=chosen)
        phase.departments = {**departments, **phase.departments}
        if phase.models is not None:
            members = [[n for n, c in phase.assignments.items() if c == k] for k in range(len(models))]
            repaired = self.strategy.repair(number, ClusteredResult(models=phase.models, members=members))
            phase.models = repaired.models
            phase.repairs = describe_repairs(repaired.repairs)
        return phase

    def _plaintext_phase(
        self, number: int, models: list[Arrays], configs: dict[int, TrainConfig], outcome: RoundOutcome,
        timings: dict[str, float],
    ) -> TrainPhase:
        """Train round trip with plaintext updates; each update is validated, then averaged (per cluster)."""
        start = self.clock()
        messages = self._messages(MessageType.TRAIN, models, configs)
        retried: dict[int, int] = {}
        replies = self._exchange(messages, outcome.failures, "train", self.config.train_deadline(),
                                 retries=self.config.train_retries, retried=retried)
        timings["train"] = self.clock() - start

        start = self.clock()
        phase = aggregate_train_replies(self.strategy, number, models, replies, outcome.failures, retried,
                                        max_reply_mb=self.config.max_reply_mb,
                                        max_weight=self.config.secagg_max_weight)
        timings["aggregate"] = self.clock() - start
        return phase

    def _final_evaluation(self, run_id: int, models: list[Arrays], nodes: Iterable[int]) -> None:
        """Each department evaluates the final model on its own test split (one message round trip):
        the global model, its cluster's (IFCA) or shared + its personal layers (FedPer), and its
        personal model (Ditto)."""
        disabled = self.repo.disabled_node_ids()
        connected = {int(n) for n in self.grid.get_node_ids()}
        targets = [n for n in nodes if n in connected and n not in disabled]
        if not targets:
            return
        outcome = RoundOutcome()
        configs = self.strategy.configure_train(self.config.num_rounds, targets, self._base)
        replies = self._exchange(
            self._messages(MessageType.EVALUATE, models, configs), outcome.failures, "evaluate", self.config.round_timeout
        )
        for node, reply in replies:
            content = reply.content
            if METRICS not in content.metric_records:
                continue
            values = {
                f"final-{k}": float(v)
                for k, v in content.metric_records[METRICS].items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
            }
            self.repo.touch_node(node, department=department_of(content))
            self.repo.add_metrics(run_id, self.config.num_rounds, values, node_id=node)
        for node, (stage, reason) in outcome.failures.items():
            if self._last_round_id is not None:
                self.repo.add_failure(self._last_round_id, node, stage=stage, reason=reason)
            log.warning("final evaluation: node %s failed: %s", node, reason)




class _RepoAudit(AuditTrail):
    """Key ceremonies and decryptions of a run, recorded in the state DB as they happen."""

    def __init__(self, federation: Federation, run_id: int) -> None:
        self.federation = federation
        self.repo = federation.repo
        self.run_id = run_id

    def ceremony_requested(self) -> bool:
        return self.repo.ceremony_requested(self.run_id)

    def ceremony_started(self, members: Sequence[int], threshold: int, params: dict[str, object]) -> int:
        return self.repo.start_ceremony(self.run_id, members=members, threshold=threshold, params=params)

    def ceremony_finished(self, ceremony: int, *, key_id: str | None, holders: Sequence[int], error: str | None) -> None:
        self.repo.finish_ceremony(ceremony, key_id=key_id, holders=holders, error=error)

    def decryption_started(self, *, key_id: str, contributors: Sequence[int], decryptors: Sequence[int]) -> int:
        round_id = self.federation._last_round_id
        if round_id is None:
            raise FederationError("a decryption outside a round")
        return self.repo.add_decryption(round_id, key_id=key_id, contributors=contributors, decryptors=decryptors)

    def decryption_finished(self, decryption: int, *, error: str | None) -> None:
        self.repo.finish_decryption(decryption, error=error)
