"""Client selection within a run: who trains each round, and what the selector learns from it.

``SelectionFeedback`` asks the run's selector for the round's nodes (K·(1 + over-selection) of them,
checked against the selector's contract), tells it afterwards how each node did (on time, late,
failed; its loss and time) and how the global model moved, records the choice and reward in the
state DB and keeps the selector's learned state under the run's selection key.
"""

from __future__ import annotations

import logging
import math

from quorumfl.errors import ConfigError
from quorumfl.server.config import RunConfig
from quorumfl.server.exchange import Exchange
from quorumfl.server.phase import RoundOutcome, TrainPhase
from quorumfl.server.selection import (
    NodeResult,
    Outcome,
    RoundFeedback,
    Selection,
    Selector,
    build_selector,
    check_selection,
    round_reward,
)
from quorumfl.server.state.repository import Repository
from quorumfl.server.strategies import Strategy

__all__ = ["SelectionFeedback"]

log = logging.getLogger(__name__)


class SelectionFeedback:
    """The selector of one run and its bookkeeping (see the module docstring)."""

    def __init__(self, config: RunConfig, strategy: Strategy, repo: Repository, exchange: Exchange) -> None:
        self.config = config
        self.strategy = strategy
        self.repo = repo
        self.exchange = exchange  # its train stage's quota, arrival times and cut-off
        self.selector: Selector = build_selector(config.selector, seed=config.seed, epochs=config.local_epochs,
                                                 epoch_choices=config.epoch_choices(), clusters=config.clusters)
        self.accuracy = math.nan  # the global (main cluster's) accuracy after the last round
        self.loss = math.nan  # and its validation loss

    def restore(self) -> None:
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

    def step(self) -> int:
        """The selector's own round count (+1): run round numbers restart with each run, while a kept
        selector's statistics ("last chosen in round t") continue across runs."""
        return self.selector.book.rounds + 1

    def select(self, available: list[int]) -> Selection:
        """K nodes from the selector (K·(1 + over-selection) asked for), checked against its contract."""
        count = self.strategy.count(len(available))
        asked = min(len(available), count + math.ceil(count * self.config.over_selection))
        selection = self.selector.select(self.step(), available, asked)
        check_selection(selection, available, asked, self.config.epoch_choices())
        self.exchange.start_train_stage(count if asked > count else None)
        return selection

    def repeat(self, nodes: list[int]) -> Selection:
        """The same nodes as an earlier attempt from the same model (secure rounds: each node's
        contribution ledger admits a second contribution from a model only with the same set)."""
        self.exchange.start_train_stage(None)
        return Selection(nodes=sorted(nodes), epochs={n: self.config.local_epochs for n in nodes}, policy="repeat")

    def learn(self, run_id: int, number: int, selection: Selection, phase: TrainPhase,
                         outcome: RoundOutcome, timings: dict[str, float], accuracy: float, loss: float) -> None:
        """Tell the selector how the round went, record its choice and reward, keep its state."""
        results: dict[int, NodeResult] = {}
        for node in selection.nodes:
            epochs = selection.epochs[node]
            if node in phase.accepted:
                values = phase.node_metrics.get(node, {})
                results[node] = NodeResult(
                    Outcome.OK, epochs, seconds=self.exchange.arrivals.get(node, values.get("train-seconds")),
                    loss=values.get("train-loss"), samples=values.get("num-examples"),
                    cluster=phase.assignments.get(node),
                )
                continue
            stage = outcome.failures.get(node, ("", ""))[0]
            if stage == "late":
                results[node] = NodeResult(Outcome.LATE, epochs, seconds=self.exchange.cut_at)
            elif stage == "deadline":
                results[node] = NodeResult(Outcome.LATE, epochs)
            else:
                results[node] = NodeResult(Outcome.FAILED, epochs)
        before = self.accuracy if math.isfinite(self.accuracy) else accuracy
        after = accuracy if math.isfinite(accuracy) else before
        seconds = sum(v for k, v in timings.items() if k != "local_train_max")
        feedback = RoundFeedback(self.step(), results, seconds, before if math.isfinite(before) else 0.0,
                                 after if math.isfinite(after) else 0.0,
                                 deadline=self.config.round_deadline or None, loss_before=self.loss,
                                 loss_after=loss if math.isfinite(loss) else self.loss)
        # a repeated set was not the selector's choice: it keeps its statistics, not a policy step
        reward = self.selector.observe(feedback) if selection.policy != "repeat" else round_reward(feedback,
                                                                                                  late_penalty=0.0)
        self.accuracy, self.loss = after, feedback.loss_after if feedback.loss_after is not None else math.nan
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
