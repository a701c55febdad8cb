"""Federated hyper-parameter search: each trial a federated run, Optuna choosing what to try next.

Optuna does the searching: its TPE sampler (or its random sampler, to compare) proposes values and
its successive-halving pruner decides from each round's figure whether a trial is worth finishing,
through its ask-and-tell interface. What it has no notion of is here:

- a trial is a federated run (``TrialRunner``: on Flower's simulation engine, on the deployed
  federation, or in-process), started with the search's base run config plus the trial's values;
- a watcher follows that run in the state DB, hands each completed round's figure (the one
  ``runs list`` shows, of the model the round started from) to the pruner, and stops a run the
  pruner gives up on as ``runs stop`` does (the round loop ends it before its next round);
- every trial is recorded in the state DB (``search_trials``): a search under the same study name
  continues from them (they are replayed into Optuna's in-memory study), and ``tune show`` lists
  them. Optuna's own database storage would share the state DB's Alembic version table.

Optuna always maximises a score: the figure, negated where lower is better (MAE).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import optuna
from optuna.pruners import BasePruner, NopPruner, SuccessiveHalvingPruner
from optuna.samplers import BaseSampler, RandomSampler, TPESampler
from optuna.trial import TrialState as OptunaState

from quorumfl.core.metric_names import higher_is_better, primary_among
from quorumfl.errors import ConfigError, NotFoundError, QuorumError
from quorumfl.privacy.budget import DEFAULT_DP_BUDGET
from quorumfl.server.config import RunConfig
from quorumfl.server.early_stop import round_figure
from quorumfl.server.search_space import SearchSpace, check_budget, privacy_plan
from quorumfl.server.services import run_summary
from quorumfl.server.state.orm import SearchTrial
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus
from quorumfl.server.state.trials import TrialState

__all__ = ["SAMPLERS", "SearchPlan", "TrialHooks", "TrialRunner", "best_trial", "run_search"]

log = logging.getLogger(__name__)

SAMPLERS = ("tpe", "random")
PRUNED_REASON = "pruned by the hyper-parameter search"


@dataclass(frozen=True)
class TrialHooks:
    """What a runner tells the search of a trial's run while it runs."""

    started: Callable[[int], None]  # its Flower run id, as soon as it is known
    # after each round, called in the round loop by a runner whose loop runs in this process: the
    # pruner then decides before the next round starts (else a watcher polls the state DB)
    round_ended: Callable[[], None]


class TrialRunner(Protocol):
    def __call__(self, values: dict[str, Any], hooks: TrialHooks) -> int:
        """Run one federated run of ``values`` and return its Flower run id when it has ended."""


@dataclass(frozen=True)
class SearchPlan:
    study: str  # the name its trials are recorded under
    base: Mapping[str, Any]  # the run-config values every trial shares
    space: SearchSpace
    trials: int  # how many trials to run now
    sampler: str = "tpe"
    prune: bool = True
    min_rounds: int = 2  # the pruner's first rung: rounds every trial runs before it can be stopped
    seed: int = 0  # the sampler's
    startup_trials: int = 0  # TPE's first trials drawn at random (0: a third of ``trials``, 2 to 10)
    max_rounds: int = 0  # start no trial once this search's trials have run this many rounds (0: no limit)
    dp_budget: float = DEFAULT_DP_BUDGET  # under DP: the ε per department the search may take them to

    def __post_init__(self) -> None:
        if not 1 <= len(self.study) <= 64:
            raise ConfigError(f"study name {self.study!r} must have 1 to 64 characters")
        if self.trials < 1:
            raise ConfigError(f"--trials must be at least 1, got {self.trials}")
        if self.sampler not in SAMPLERS:
            raise ConfigError(f"--sampler must be one of {list(SAMPLERS)}, got {self.sampler!r}")
        if self.max_rounds < 0:
            raise ConfigError(f"--rounds-budget must be 0 (none) or more, got {self.max_rounds}")
        if self.min_rounds < 1:
            raise ConfigError(f"--min-rounds must be at least 1, got {self.min_rounds}")
        if self.base.get("start-from", "fresh") != "fresh":
            raise ConfigError("every trial of a search starts from new weights drawn from the seed, so trials "
                              "compare from the same start; remove start-from from [run]")


def run_search(repo: Repository, plan: SearchPlan, runner: TrialRunner, *, spent: float = 0.0, poll: float = 1.0,
               on_trial: Callable[[SearchTrial], None] | None = None) -> list[SearchTrial]:
    """Run ``plan.trials`` more trials of the study; every trial of it, in order. Under DP the search's
    ε (``privacy_plan``) on top of ``spent`` (the most any department has spent) must fit
    ``plan.dp_budget``, or nothing runs."""
    check_budget(privacy_plan(RunConfig.from_mapping(dict(plan.base)), plan.trials), spent, plan.dp_budget)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # a continued study's sampler is seeded past its recorded trials, so it does not draw them again
    sampler = _sampler(plan, seed=plan.seed + len(repo.trials(plan.study)))
    study = optuna.create_study(direction="maximize", sampler=sampler, pruner=_pruner(plan))
    _replay(repo, plan, study)
    heads, rounds = repo.heads(), 0
    try:
        for _ in range(plan.trials):
            if plan.max_rounds and rounds >= plan.max_rounds:
                break
            rounds += len(_one_trial(repo, plan, runner, study, poll, on_trial).figures)
    finally:
        _restore_heads(repo, heads, {t.run_id for t in repo.trials(plan.study) if t.run_id is not None})
    return repo.trials(plan.study)


def _one_trial(repo: Repository, plan: SearchPlan, runner: TrialRunner, study: optuna.Study, poll: float,
               on_trial: Callable[[SearchTrial], None] | None) -> SearchTrial:
    trial = study.ask(dict(plan.space.dimensions))
    record = repo.start_trial(plan.study, trial.params, plan.space.to_record())
    watch = _Watch(repo, trial, record.id, prune=plan.prune, poll=poll)
    # Every trial starts from new weights drawn from the run config's seed, so trials are independent
    # and compared from the same start. Its figure is the federation's model's: each node's
    # department-alone model would double its training for nothing the search reads, unless the
    # search config asks for it.
    values = {"local-baseline": False, **plan.base, **trial.params, "start-from": "fresh"}
    state, score = watch.run(runner, values)
    study.tell(trial, score, state=state)
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    repo.note_trial(record.id, {k: v for k, v in frozen.system_attrs.items() if isinstance(v, int | float | str)})
    done = next(t for t in repo.trials(plan.study) if t.id == record.id)
    log.info("search %s: trial %s %s (%s = %s)", plan.study, done.number, done.state, done.metric, done.value)
    if on_trial is not None:
        on_trial(done)
    return done


def _restore_heads(repo: Repository, before: dict[str, int], trial_runs: set[int]) -> None:
    """Trials leave the model lineages as they found them: a head a trial's run moved goes back to
    where it was before the search (or away, where there was none); the best trial's models stay in
    the model store ('models list --run RUN'), for 'models rollback' to make one the head."""
    now = repo.heads()
    wanted = dict(now)
    for architecture, version_id in now.items():
        if repo.get_model_version(version_id).run_id in trial_runs:
            if architecture in before:
                wanted[architecture] = before[architecture]
            else:
                del wanted[architecture]
    if wanted != now:
        repo.restore_heads(wanted)


def best_trial(trials: list[SearchTrial]) -> SearchTrial | None:
    """The complete trial with the best final figure (None: none completed)."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    if not complete:
        return None
    return max(complete, key=lambda t: _score(t.value, t.higher_is_better))


def _score(value: float | None, higher: bool) -> float:
    return math.nan if value is None else (value if higher else -value)


def _sampler(plan: SearchPlan, *, seed: int) -> BaseSampler:
    if plan.sampler == "random":
        return RandomSampler(seed=seed)
    # TPE models good and bad values from the trials so far; its first ones are drawn at random
    return TPESampler(seed=seed, n_startup_trials=plan.startup_trials or max(2, min(10, plan.trials // 3)))


def _pruner(plan: SearchPlan) -> BasePruner:
    if not plan.prune:
        return NopPruner()
    return SuccessiveHalvingPruner(min_resource=plan.min_rounds, reduction_factor=3)


def _replay(repo: Repository, plan: SearchPlan, study: optuna.Study) -> None:
    """The study's recorded trials into Optuna's study (a running one left by an interrupted search
    is recorded failed); refuses a study recorded with another search space."""
    wanted = plan.space.to_record()
    for record in repo.trials(plan.study):
        if record.space != wanted:
            raise ConfigError(f"study '{plan.study}' searched {sorted(record.space)} with other ranges; give the "
                              "same [search] table to continue it, or another --study name")
        if record.state == TrialState.RUNNING:
            repo.finish_trial(record.id, TrialState.FAILED)
            record.state = TrialState.FAILED
        state = {TrialState.COMPLETE: OptunaState.COMPLETE, TrialState.PRUNED: OptunaState.PRUNED}.get(
            TrialState(record.state), OptunaState.FAIL)
        score = _score(record.value, record.higher_is_better)
        study.add_trial(optuna.trial.create_trial(
            params=dict(record.params), distributions=dict(plan.space.dimensions), state=state,
            value=score if state is OptunaState.COMPLETE else None,
            intermediate_values={int(k): _score(v, record.higher_is_better) for k, v in record.figures.items()},
            system_attrs=dict(record.notes)))


class _Watch:
    """One trial's run, followed in the state DB from a thread while the runner runs it."""

    def __init__(self, repo: Repository, trial: optuna.Trial, record: int, *, prune: bool, poll: float) -> None:
        self.repo, self.trial, self.record, self.prune, self.poll = repo, trial, record, prune, poll
        self.flower_run_id: int | None = None
        self.figures: dict[str, float] = {}
        self.pruned = False
        self.done = threading.Event()
        self.lock = threading.Lock()  # the watcher thread and the round loop's hook step in turn

    def run(self, runner: TrialRunner, values: dict[str, Any]) -> tuple[OptunaState, float | None]:
        thread = threading.Thread(target=self._loop, name="search-watch", daemon=True)
        thread.start()
        try:
            flower_run_id = runner(values, TrialHooks(started=self._started, round_ended=self._step))
        except QuorumError as exc:  # the trial's run failed (recorded with its reason): the search goes on
            log.warning("search: trial %s failed: %s", self.trial.number, exc)
            self.done.set()
            thread.join()
            self._step()
            self.repo.finish_trial(self.record, TrialState.FAILED)
            return OptunaState.FAIL, None
        except BaseException:
            self.done.set()
            thread.join()
            self.repo.finish_trial(self.record, TrialState.FAILED)
            raise
        self.done.set()
        thread.join()
        self.flower_run_id = flower_run_id
        self._step()  # the rounds that ended since the last poll
        return self._outcome()

    def _started(self, flower_run_id: int) -> None:
        self.flower_run_id = flower_run_id

    def _loop(self) -> None:
        while not self.done.wait(self.poll):
            try:
                self._step()
            except Exception:  # a failed poll is retried at the next; the runner's result decides
                log.exception("search: following trial %s failed", self.trial.number)

    def _step(self) -> None:
        with self.lock:
            self._follow()

    def _follow(self) -> None:
        if self.flower_run_id is None:
            return
        try:
            run = self.repo.get_run(self.flower_run_id)
        except NotFoundError:
            return
        metrics = [m for m in self.repo.metrics(run.id) if m.node_id is None]
        primary = primary_among(m.name for m in metrics)
        higher = higher_is_better(primary)
        numbers = sorted({r.number for r in run.rounds if r.status == RoundStatus.COMPLETED})
        fresh = [n for n in numbers if str(n) not in self.figures]
        for number in fresh:
            figure = round_figure({m.name: m.value for m in metrics if m.round == number}, primary)
            if figure is None:
                continue
            self.figures[str(number)] = figure
            self.trial.report(_score(figure, higher), number)
        self.repo.update_trial(self.record, run_id=run.id, metric=primary, higher_is_better=higher,
                               figures=self.figures)
        if (fresh and self.prune and not self.pruned and run.status == RunStatus.RUNNING
                and self.trial.should_prune()):
            self.pruned = True
            self.repo.finish_run(run.id, RunStatus.STOPPED, error=f"{PRUNED_REASON} after round {numbers[-1]}")

    def _outcome(self) -> tuple[OptunaState, float | None]:
        if self.flower_run_id is None:
            self.repo.finish_trial(self.record, TrialState.FAILED)
            return OptunaState.FAIL, None
        run = self.repo.get_run(self.flower_run_id)
        summary = run_summary(self.repo, run)
        final = summary["final_metric"]
        if self.pruned:
            self.repo.finish_trial(self.record, TrialState.PRUNED)
            return OptunaState.PRUNED, None
        if run.status in (RunStatus.COMPLETED, RunStatus.PARTIAL) and final is not None and math.isfinite(final):
            primary = primary_among(m.name for m in self.repo.metrics(run.id))
            higher = higher_is_better(primary)
            self.repo.update_trial(self.record, run_id=run.id, metric=primary, higher_is_better=higher)
            self.repo.finish_trial(self.record, TrialState.COMPLETE, float(final))
            return OptunaState.COMPLETE, _score(float(final), higher)
        self.repo.finish_trial(self.record, TrialState.FAILED)
        return OptunaState.FAIL, None
