"""The federation loop on Flower's Grid: select → train → validate & aggregate → evaluate → store.

The loop is the same for every strategy and mode: the strategy configures each node's training,
the round mode (``modes.py``: plaintext, masking, CKKS) runs the train phase, round trips go
through ``exchange.py``, client selection and its learning through ``feedback.py``, and an
interrupted run is taken up by ``resuming.py``.

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
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import numpy as np
from flwr.app import MessageType
from flwr.serverapp import Grid
from numpy.typing import NDArray

from quorumfl.aggregation.compression import warmup_fraction
from quorumfl.aggregation.momentum import ServerMomentum
from quorumfl.aggregation.secagg.identity import Roster
from quorumfl.core.metric_names import higher_is_better
from quorumfl.core.models import (
    QAT_PREFIX,
    arrays_to_model,
    model_to_arrays,
    split_control,
)
from quorumfl.core.tasks import get_task
from quorumfl.errors import (
    FederationError,
    RunStoppedError,
)
from quorumfl.protocol.wire import (
    METRICS,
    TrainConfig,
    department_of,
)
from quorumfl.server.config import DpMode, RunConfig, SecureMode, StartFrom
from quorumfl.server.early_stop import EARLY_STOP, EarlyStop, round_figure
from quorumfl.server.exchange import Exchange, requests
from quorumfl.server.feedback import SelectionFeedback
from quorumfl.server.model_store import ModelStore
from quorumfl.server.modes import IFCA_PICK, RoundMode, build_mode
from quorumfl.server.phase import RoundOutcome
from quorumfl.server.replies import (
    ReplyError,
    parse_train_reply,
)
from quorumfl.server.resuming import last_attempt_set, resume_point, take_up
from quorumfl.server.run_task import federated_metric, run_task
from quorumfl.server.selection import Selection
from quorumfl.server.state.repository import (
    INTERRUPTED,
    STOPPED_BY_ADMIN,
    Repository,
    RoundStatus,
    RunStatus,
)
from quorumfl.server.strategies import Strategy, build_strategy
from quorumfl.training.local import evaluate

__all__ = ["IFCA_PICK", "Federation", "ReplyError", "parse_train_reply"]

log = logging.getLogger(__name__)
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


def _or(value: float, otherwise: float) -> float:
    return value if math.isfinite(value) else otherwise


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
        self.task = run_task(config)  # the model spec nodes build, the objective, the server's held-out set
        self.strategy: Strategy = build_strategy(config)
        self.exchange = Exchange(grid, repo, roster=self.roster, flower_run_id=flower_run_id,
                                 round_deadline=config.round_deadline, clock=clock)
        self.mode: RoundMode = build_mode(config, self.strategy, self.exchange, repo, flower_run_id=flower_run_id,
                                          clock=clock)
        self.feedback = SelectionFeedback(config, self.strategy, repo, self.exchange)
        self.model = self.task.spec.build(seed=0)  # the server's instance: it loads each model it evaluates
        # FedAvgM's buffer lives in this process: a resumed run or a rollback starts it again from 0
        momentum, step = config.server_step()
        self.momentum = ServerMomentum(momentum=momentum, learning_rate=step,
                                       names=[name for name, _ in self.model.named_parameters()])
        self._qat_template: Arrays | None = None  # a QAT round's unset activation ranges (built once)
        self.dp_noise = distributed_noise(config)  # distributed DP: σ on each revealed sum, else None
        # secure rounds: the nodes of a failed attempt whose model the next round trains from again
        self.repeat_set: list[int] | None = None
        # the settings a node takes as they are (declared node=True in server/config.py), plus what the
        # server decides: the round, μ (the strategy's, per node) and distributed DP's σ
        self._base = TrainConfig(
            server_round=0, proximal_mu=0.0, dp_noise_multiplier=self.dp_noise or config.dp_noise_multiplier,
            task=config.task, schema=self.task.spec.schema_json, **config.node_settings(),
        )

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
        # a task's statistics round (the first of a fresh run) goes at full precision: statistics are not
        # an update that error feedback could spread over later rounds
        statistics = number == 1 and not self.config.resume_run and getattr(get_task(self.config.task),
                                                                            "needs_statistics", False)
        return replace(self._base, compression_seed=seed,
                       compression_full=(bool(every) and number % every == 0) or statistics,
                       compression_fraction=fraction)

    def _initial(self) -> tuple[list[str], list[Arrays], list[int | None]]:
        arch = self.task.spec.architecture()
        lineages = self.strategy.lineages(arch)
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
            model = self.task.spec.build(seed=self.config.seed + k)
            models.append(self.strategy.server_arrays(model_to_arrays(model)))
            parents.append(None)
        return lineages, models, parents

    def _qat_arrays(self, arrays: Arrays, qat: bool) -> Arrays:
        """The model as a round sends it: with activation ranges in a QAT round (zeros, unset, before the
        first one), without them otherwise (a run that starts from a QAT version trains plainly)."""
        ranges = {k for k in arrays if k.startswith(QAT_PREFIX)}
        if not qat:
            return {k: v for k, v in arrays.items() if k not in ranges} if ranges else arrays
        return arrays if ranges else {**arrays, **self._range_template()}

    def _range_template(self) -> Arrays:
        """The unset activation ranges of this run's model (``training.qat.range_template``), built once;
        it refuses a model INT8 cannot run."""
        if self._qat_template is None:
            from quorumfl.training.qat import range_template

            spec = self.task.spec
            self._qat_template = dict(range_template(self.model, tuple(spec.resolve().input_shape(spec.schema))))
        return self._qat_template

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
                + (f" (secure-aggregation {self.config.secure_aggregation.value} needs at least 2)"
                   if self.config.secure_aggregation is not SecureMode.NONE else "")
            )
        return nodes

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, *, on_round: Callable[[int, int, dict[str, float]], None] | None = None) -> int:
        """Run all rounds; returns the QuorumFL run id. The run is marked failed on any error.
        With ``resume-run``, an interrupted run continues after its last finished round. ``on_round``
        gets (run id, round number, the round's metrics; empty when it failed) after each round."""
        config = self.config
        if config.resume_run:
            run = take_up(self.repo, config, config.resume_run, self.flower_run_id)
        else:
            run = self.repo.create_run(
                flower_run_id=self.flower_run_id,
                config=config.resolved(),
                strategy=config.strategy.value,
                num_rounds=config.num_rounds,
            )
        self.mode.start(run.id)
        try:
            lineages, models, parents = self._initial()
            if config.qat_rounds:  # a model INT8 cannot run is refused before any round, not at the first QAT one
                self._range_template()
            first, completed, seen = 1, 0, set[int]()
            if config.resume_run:
                first, completed, seen = resume_point(self.repo, self.store, run, lineages, models, parents)
                self.repeat_set = last_attempt_set(self.repo.list_rounds(run.id))
            model = self.model
            self.feedback.restore()
            value, self.feedback.loss = self._server_evaluation(model, models[0])
            self.feedback.accuracy = self.task.objective.score(value)
            stop, last = EarlyStop(config.early_stop_patience, higher_is_better(self.task.primary)), first - 1
            for number in range(first, config.num_rounds + 1):
                if self.repo.run_status(run.id) is RunStatus.STOPPED:
                    log.info("run %s was stopped by the admin before round %s", run.id, number)
                    return run.id
                for k, lineage in enumerate(lineages):
                    head = self.repo.head_version(lineage)
                    if parents[k] is not None and head is not None and head.id != parents[k]:
                        log.info("head of %s moved to version %s (rollback); continuing from it", lineage, head.id)
                        models[k], parents[k] = self.store.load(head.path, head.sha256), head.id
                        self.momentum.buffer.clear()
                models, parents, metrics = self._round(run.id, number, lineages, models, parents, model, seen)
                completed, last = completed + bool(metrics), number
                if on_round is not None:
                    on_round(run.id, number, metrics)
                if stop.update(round_figure(metrics, self.task.primary)):
                    self.repo.add_metrics(run.id, number, {EARLY_STOP: float(number)})
                    log.info("run %s: no better %s in %s rounds; stopping after round %s", run.id,
                             self.task.primary, config.early_stop_patience, number)
                    break
            if completed == 0:
                raise FederationError(
                    f"none of the {config.num_rounds} round(s) completed; 'quorumfl rounds list' shows why"
                )
            self._final_evaluation(run.id, models, sorted(seen))
            lost = last - completed
        except RunStoppedError as exc:
            # An admin's 'runs stop' was recorded while this ServerApp was between rounds (Flower ends
            # it soon after): the run stays stopped, and no round is left running.
            self.repo.abort_running_rounds(run.id, STOPPED_BY_ADMIN)
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
        if lost:  # the model is what the completed rounds made: say so, with its own status and exit code
            self.repo.finish_run(run.id, RunStatus.PARTIAL, error=f"{lost} of {last} round(s) failed; "
                                 "'quorumfl rounds list' shows why")
        else:
            self.repo.finish_run(run.id, RunStatus.COMPLETED)
        return run.id

    # ---- one round ----------------------------------------------------------------------------
    def _round(
        self,
        run_id: int,
        number: int,
        lineages: list[str],
        models: list[Arrays],
        parents: list[int | None],
        model: Any,
        seen: set[int],
    ) -> tuple[list[Arrays], list[int | None], dict[str, float]]:
        config = self.config
        available = self._available_nodes()
        for node in available:  # registry: connected nodes, named once they reply
            self.repo.touch_node(node)
        selection = self._selection(number, available)
        selected = sorted(selection.nodes)
        rnd = self.repo.start_round(run_id, number, selected)
        self.exchange.round_id, self.exchange.round_number = rnd.id, number
        sent_before = self.exchange.sent_bytes
        outcome = RoundOutcome()
        timings: dict[str, float] = {}

        qat = number > config.num_rounds - config.qat_rounds  # a federated QAT round (the last qat-rounds)
        models = [self._qat_arrays(arrays, qat) for arrays in models]
        configs = {node: replace(cfg, local_epochs=selection.epochs[node], qat=qat) for node, cfg in
                   self.strategy.configure_train(number, selected, self._compression_round(number)).items()}
        phase = self.mode.train(number, available, models, configs, outcome, timings)
        for node in phase.accepted:
            self.repo.touch_node(node, department=phase.departments.get(node))
            seen.add(node)
        timings["local_train_max"] = max(
            (phase.node_metrics.get(n, {}).get("train-seconds", 0.0) for n in phase.accepted), default=0.0
        )

        for node, (stage, reason) in outcome.failures.items():
            self.repo.add_failure(rnd.id, node, stage=stage, reason=reason)
            log.warning("round %s: node %s failed at %s: %s", number, node, stage, reason)
        for node, reason in self.exchange.stray:
            self.repo.add_failure(rnd.id, node, stage="rejected", reason=reason)
        self.exchange.stray = []

        new_models = phase.models if phase.models is not None else ([phase.arrays] if phase.arrays is not None else None)
        if new_models is None or len(phase.accepted) < config.min_nodes:
            why = phase.error or (
                f"{len(phase.accepted)} valid update(s) of {len(selected)} selected; min-nodes is {config.min_nodes}"
            )
            self.repo.finish_round(rnd.id, RoundStatus.FAILED, participants=phase.accepted, timings=timings, error=why)
            log.warning("round %s failed: %s; the global model is unchanged", number, why)
            self.repeat_set = selected  # the next round trains from this model again
            self.feedback.learn(run_id, number, selection, phase, outcome, timings, self.feedback.accuracy,
                                self.feedback.loss)
            return models, parents, {}

        self.repeat_set = None
        if len(new_models) == 1:  # the server's step on the revealed mean (FedAvgM; plain FedAvg: the mean)
            new_models = [self.momentum.step(models[0], new_models[0])]
        start = self.clock()
        members = [sum(1 for c in phase.assignments.values() if c == k) for k in range(len(new_models))]
        evals = [self._server_evaluation(model, arrays) for arrays in new_models]
        main = max(range(len(new_models)), key=lambda k: (members[k], -k))  # the cluster serving the most nodes
        timings["evaluate"] = self.clock() - start
        primary = self.task.primary
        round_metrics = {
            primary: evals[main][0],
            "loss": evals[main][1],
            # the model this round started from, as the departments measured it on their own test splits
            # (a secure round reveals only the weighted mean, in the objective's unit)
            f"federated-{primary}": _or(federated_metric(phase.node_metrics, f"global-{primary}"),
                                        phase.eval_value * self.task.objective.unit),
            "federated-loss": _or(federated_metric(phase.node_metrics, "global-loss"), phase.eval_loss),
            "train-loss": phase.train_loss,
            "participants": float(len(phase.accepted)),
            "examples": phase.total_examples,
            "downlink-bytes": float(self.exchange.sent_bytes - sent_before),  # arrays in every request of the round
            # Peak RSS of the ServerApp process so far (Linux reports KiB).
            "server-peak-rss-mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        }
        watched, notes = phase.monitoring()  # updates or (secure rounds) histograms that stand out
        round_metrics.update(watched)
        for note in notes:
            log.warning("round %s: %s", number, note)
        if self.dp_noise is not None:  # distributed DP: the federation's ε after this many rounds
            round_metrics["dp-federation-epsilon"] = self._federation_epsilon(number)
        if len(new_models) > 1:
            round_metrics["clusters-repaired"] = float(len(phase.repairs))
            for k in range(len(new_models)):
                round_metrics[f"{primary}-cluster-{k}"] = evals[k][0]
                round_metrics[f"nodes-cluster-{k}"] = float(members[k])
            for repair in phase.repairs:
                log.info("round %s: %s", number, repair)

        start = self.clock()
        versions: list[int | None] = []
        for k, arrays in enumerate(new_models):
            suffix = f"-cluster{k}" if len(new_models) > 1 else ""
            stored = self.store.save(arrays, f"run{run_id}-round{number:04d}{suffix}")
            version_metrics = {primary: evals[k][0], "loss": evals[k][1]}
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
        # the selector learns from the server's held-out figures, or (no held-out set) the round's train loss
        score = self.task.objective.score(evals[main][0])
        loss = evals[main][1] if self.task.holdout is not None else phase.train_loss
        self.feedback.learn(run_id, number, selection, phase, outcome, timings, score, loss)
        log.info(
            "round %s/%s: %s %.4f, %s of %s nodes, %.1fs",
            number, config.num_rounds, primary, evals[main][0], len(phase.accepted), len(selected),
            sum(timings.values()),
        )
        return new_models, versions, round_metrics

    def _selection(self, number: int, available: list[int]) -> Selection:
        """The selector's choice; under secure aggregation, after a failed attempt from the same model,
        that attempt's nodes again (their ledgers refuse another set), or, when some of them are not
        connected, the selector's choice with a warning naming them."""
        again = self.repeat_set
        if again is None or self.config.secure_aggregation is SecureMode.NONE:
            return self.feedback.select(available)
        missing = sorted(set(again) - set(available))
        if not missing:
            return self.feedback.repeat(again)
        names = {n.node_id: n.department for n in self.repo.list_nodes()}
        log.warning("round %s trains from the model of a failed attempt with %s; %s not connected: the others "
                    "train it with another set, and those that confirmed the attempt refuse (their contribution "
                    "ledgers); start those nodes and resume the run to keep every department", number,
                    ", ".join(names.get(n) or str(n) for n in again),
                    ", ".join(names.get(n) or str(n) for n in missing) + (" is" if len(missing) == 1 else " are"))
        return self.feedback.select(available)

    # ---- evaluation ---------------------------------------------------------------------------
    def _server_evaluation(self, model: Any, arrays: Arrays) -> tuple[float, float]:
        """(the task's primary metric, loss) on the server's held-out set; NaN where there is none (tabular
        and text tasks: the departments evaluate) or the strategy's server model cannot be evaluated
        there (FedPer's has no head)."""
        test = self.task.holdout
        if test is None or not self.strategy.evaluates_on_server():
            return math.nan, math.nan
        arrays_to_model(model, split_control(arrays)[0])  # SCAFFOLD: not its control variates
        result = evaluate(model, test)
        return result.value, result.loss

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
        replies = self.exchange(
            requests(MessageType.EVALUATE, models, configs), outcome.failures, "evaluate", self.config.round_timeout
        )
        finals: dict[int, dict[str, float]] = {}
        for node, reply in replies:
            content = reply.content
            if METRICS not in content.metric_records:
                continue
            finals[node] = {
                k: float(v) for k, v in content.metric_records[METRICS].items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
            }
            self.repo.touch_node(node, department=department_of(content))
            self.repo.add_metrics(run_id, self.config.num_rounds, {f"final-{k}": v for k, v in finals[node].items()},
                                  node_id=node)
        # The final model as the departments measured it (example-weighted): 'final' where the server holds no data.
        primary = self.task.primary
        final = {f"final-federated-{primary}": federated_metric(finals, primary),
                 "final-federated-loss": federated_metric(finals, "loss")}
        self.repo.add_metrics(run_id, self.config.num_rounds, {k: v for k, v in final.items() if math.isfinite(v)})
        for node, (stage, reason) in outcome.failures.items():
            if self.exchange.round_id is not None:
                self.repo.add_failure(self.exchange.round_id, node, stage=stage, reason=reason)
            log.warning("final evaluation: node %s failed: %s", node, reason)
