"""A run's summary as the run list, ``runs show``, the report and scripts read it: status, privacy,
rounds and the final model's figure. With SQLAlchemy Core alone (``state.listing``), so that
``quorumfl runs list`` starts without the ORM."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Engine

from quorumfl.core.metric_names import primary_among
from quorumfl.server.early_stop import EARLY_STOP
from quorumfl.server.run_labels import privacy_view, task_label
from quorumfl.server.state.listing import RunFacts, list_run_facts

__all__ = ["iso", "round_metric", "run_summaries", "summarise"]


def iso(value: Any) -> str | None:
    return value.isoformat(timespec="seconds") if value is not None else None


def round_metric(primary: str, names: Iterable[str]) -> str:
    """Which per-round figure a run has: the server's own (``accuracy`` on its held-out set); for a task
    whose data only the departments hold, ``federated-<primary>`` (the model each round started from,
    as the departments measured it on their own test splits; a secure round reveals only its securely
    averaged value); else (runs recorded before secure rounds carried it) the averaged ``train-loss``."""
    present = set(names)
    for name in (primary, f"federated-{primary}"):
        if name in present:
            return name
    return "train-loss" if "train-loss" in present else primary


def run_summaries(engine: Engine) -> list[dict[str, Any]]:
    """Every run's summary, oldest first, read in a fixed number of queries."""
    return [summarise(facts) for facts in list_run_facts(engine)]


def summarise(facts: RunFacts) -> dict[str, Any]:
    """A run's status, privacy, rounds and metric figures as the run list and the report show them."""
    run = facts.run
    primary = primary_among(facts.metric_names)
    column = round_metric(primary, [m.name for m in facts.run_metrics])
    values = {m.round: m.value for m in facts.run_metrics if m.name == column}
    last = max(values) if values else None
    final = values[last] if last is not None else None
    if column.startswith("federated-"):  # each round's figure is of the model it started from: the final
        # model's is the departments' final evaluation (none when it did not take place)
        final = next((m.value for m in facts.run_metrics if m.name == f"final-{column}"), None)
    privacy = privacy_view(run.config)
    return {
        "id": run.id,
        "flower_run_id": str(run.flower_run_id) if run.flower_run_id is not None else None,
        "status": run.status,
        "strategy": run.strategy,
        "task": task_label(run.config),
        "dataset": run.config.get("dataset"),
        "model": run.config.get("model"),
        "secure_aggregation": privacy["mode"],  # masked, ckks or plaintext
        "dp": privacy["dp"],
        "threshold": privacy["threshold"],
        "privacy": privacy["sentence"],
        "privacy_label": privacy["label"],
        "rounds_planned": run.num_rounds,
        "rounds_completed": facts.rounds_completed,
        "primary_metric": primary,  # the task's: accuracy, or mae for regression
        "round_metric": column,  # the server's held-out figure, or the departments' federated evaluation
        "final_metric": final,  # the final model's
        "final_accuracy": final if primary == "accuracy" else None,
        # the round after which the run stopped early (early-stop-patience), else None
        "stopped_early_after": next((int(m.value) for m in facts.run_metrics if m.name == EARLY_STOP), None),
        "started_at": iso(run.started_at),
        "finished_at": iso(run.finished_at),
        "error": run.error,
    }
