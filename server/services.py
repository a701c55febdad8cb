"""What the admin commands do, apart from printing: views of runs, rounds, nodes and models as
plain dicts (rendered as Rich tables or JSON by the CLI), and the operations that change state.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from quorumfl.core.metric_names import PRIMARY_METRICS
from quorumfl.errors import FederationError, QuorumError, RoundsLostError
from quorumfl.server.following import follow_run, progress_line
from quorumfl.server.joining import GAIN, VERDICT, alone_sentence, compare_alone
from quorumfl.server.run_summary import iso, round_metric, run_summaries, summarise
from quorumfl.server.state.listing import MetricRow, RunFacts, RunRow
from quorumfl.server.state.orm import Metric, ModelVersion, Round, Run
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus

__all__ = [
    "export_model",
    "follow_run",
    "model_view",
    "models_view",
    "nodes_view",
    "progress_line",
    "round_flags",
    "round_view",
    "run_closing",
    "run_outcome_error",
    "round_metric",
    "run_summaries",
    "run_summary",
    "summarise",
    "run_view",
]


def run_summary(repo: Repository, run: Run) -> dict[str, Any]:
    """One run's summary (its rounds loaded); ``run_summaries`` reads the same for every run at once."""
    metrics = repo.metrics(run.id)
    completed = len({r.number for r in run.rounds if r.status == RoundStatus.COMPLETED})
    facts = RunFacts(RunRow.of(run), completed, frozenset(m.name for m in metrics),
                     [MetricRow(m.round, m.name, m.value) for m in metrics if m.node_id is None])
    return summarise(facts)


def round_view(rnd: Round, departments: dict[int, str | None]) -> dict[str, Any]:
    return {
        "round": rnd.number,
        "attempt": rnd.attempt,
        "status": rnd.status,
        "selected": len(rnd.selected),
        "participants": [departments.get(n) or str(n) for n in rnd.participants],
        "timings_s": rnd.timings,
        "failures": [
            {"node": departments.get(f.node_id) or str(f.node_id), "node_id": str(f.node_id), "stage": f.stage, "reason": f.reason}
            for f in rnd.failures
        ],
        "error": rnd.error,
    }


def round_flags(repo: Repository, run_id: int, departments: dict[int, str | None]) -> dict[int, dict[str, Any]]:
    """Per round, what the update monitoring flagged: ``count`` (plaintext: flagged updates; secure rounds:
    departments counted in the histograms' high buckets) and, in plaintext, which ``departments``."""
    flags: dict[int, dict[str, Any]] = {}
    for metric in repo.metrics(run_id, name="flagged-nodes"):
        flags.setdefault(metric.round, {"count": int(metric.value), "departments": []})["count"] = int(metric.value)
    for metric in repo.metrics(run_id, name="update-flagged"):
        if metric.value and metric.node_id is not None:
            row = flags.setdefault(metric.round, {"count": 0, "departments": []})
            row["departments"].append(departments.get(metric.node_id) or str(metric.node_id))
    return flags


def department_finals(metrics: list[Metric], departments: dict[int, str | None]) -> list[dict[str, Any]]:
    """Per department: the final global (and personal) model's metrics on its own test split."""
    rows: dict[int, dict[str, Any]] = {}
    for metric in metrics:
        if metric.node_id is None or not metric.name.startswith("final-"):
            continue
        row = rows.setdefault(
            metric.node_id, {"department": departments.get(metric.node_id) or str(metric.node_id), "node_id": str(metric.node_id)}
        )
        row[metric.name.removeprefix("final-")] = metric.value
    return sorted(rows.values(), key=lambda r: str(r["department"]))


def department_columns(rows: list[dict[str, Any]], primary: str) -> list[str]:
    """The per-department table's columns: the task's primary metric (and the personal model's, and the
    cluster, where a run has them), the loss and the example count."""
    extra = [c for c in (f"personal-{primary}", f"tuned-{primary}", f"alone-{primary}", GAIN, VERDICT, "cluster")
             if any(c in d for d in rows)]
    return ["department", primary, *extra, "loss", "num-examples"]


def run_view(repo: Repository, ref: int) -> dict[str, Any]:
    run = repo.get_run(ref)
    departments = {n.node_id: n.department for n in repo.list_nodes()}
    metrics = repo.metrics(run.id)
    global_metrics: dict[int, dict[str, float]] = {}
    for metric in metrics:
        if metric.node_id is None and not metric.name.startswith("final-"):  # final-*: the run's, in its summary
            global_metrics.setdefault(metric.round, {})[metric.name] = metric.value
    rounds = []
    for rnd in run.rounds:
        view = round_view(rnd, departments)
        # An aborted attempt has no metrics of its own: those of its number belong to the redo.
        view["metrics"] = global_metrics.get(rnd.number, {}) if rnd.status != RoundStatus.ABORTED else {}
        rounds.append(view)
    summary = run_summary(repo, run)
    finals = compare_alone(department_finals(metrics, departments), summary["primary_metric"])
    return {
        **summary,
        "config": run.config,
        "rounds": rounds,
        "departments": finals,
        "joining": alone_sentence(finals, summary["primary_metric"]),
    }


def nodes_view(repo: Repository, run_ref: int | None = None) -> list[dict[str, Any]]:
    """Known nodes; with a run, also each node's cluster in the run's last round it trained in (IFCA)
    and its final accuracy with the federation's model and with its personal model."""
    per_node: dict[int, dict[str, Any]] = {}
    if run_ref is not None:
        run = repo.get_run(run_ref)
        last_cluster: dict[int, tuple[int, float]] = {}
        for metric in repo.metrics(run.id):
            if metric.node_id is None:
                continue
            row = per_node.setdefault(metric.node_id, {})
            if metric.name == "cluster" and metric.round >= last_cluster.get(metric.node_id, (-1, 0.0))[0]:
                last_cluster[metric.node_id] = (metric.round, metric.value)
            elif metric.name in {f"final-{p}" for p in PRIMARY_METRICS} | {f"final-personal-{p}" for p in PRIMARY_METRICS}:
                row[metric.name.removeprefix("final-")] = metric.value
        for node, (_, value) in last_cluster.items():
            per_node[node]["cluster"] = int(value)
    rows = []
    for n in repo.list_nodes():
        if run_ref is not None and n.node_id not in per_node:
            continue
        rows.append({
            "node_id": str(n.node_id),
            "department": n.department,
            "enabled": n.enabled,
            "first_seen": iso(n.first_seen),
            "last_seen": iso(n.last_seen),
            **per_node.get(n.node_id, {}),
        })
    return rows


def keys_view(repo: Repository, ref: int) -> dict[str, Any]:
    """A run's key ceremonies (who holds shares of which key) and every threshold decryption."""
    departments = {n.node_id: n.department for n in repo.list_nodes()}

    def named(ids: list[int]) -> list[str]:
        return [departments.get(i) or str(i) for i in ids]

    run = repo.get_run(ref)
    ceremonies = [
        {
            "ceremony": c.id,
            "status": c.status,
            "key_id": c.key_id,
            "threshold": f"{c.threshold} of {len(c.members)}" if c.threshold else None,
            "holders": named(c.holders),
            "requested_at": iso(c.requested_at),
            "finished_at": iso(c.finished_at),
            "error": c.error,
        }
        for c in repo.ceremonies(run.id)
    ]
    decryptions = [
        {
            "round": number,
            "status": d.status,
            "key_id": d.key_id,
            "contributors": len(d.contributors),
            "decryptors": named(d.decryptors),
            "error": d.error,
        }
        for number, d in repo.decryptions(run.id)
    ]
    return {"run": run.id, "ceremonies": ceremonies, "decryptions": decryptions}


def selection_view(repo: Repository, ref: int) -> dict[str, Any]:
    """A run's client selection: per node how often it was chosen and how it did, per round which
    policy chose (the RL agent or its fallback) and the reward, and the selector state's key."""
    run = repo.get_run(ref)
    records = repo.selections(run.id)
    departments = {n.node_id: n.department for n in repo.list_nodes()}
    nodes: dict[int, dict[str, Any]] = {}
    for record in records:
        for node, epochs in record.choices:
            row = nodes.setdefault(node, {"node_id": node, "department": departments.get(node), "selected": 0,
                                          "epochs": 0, "ok": 0, "late": 0, "failed": 0})
            row["selected"] += 1
            row["epochs"] += epochs
            outcome = record.outcomes.get(str(node), "failed")
            row[outcome] = row.get(outcome, 0) + 1
    for row in nodes.values():
        row["mean_epochs"] = row.pop("epochs") / row["selected"]
    policies: dict[str, int] = {}
    for record in records:
        policies[record.policy] = policies.get(record.policy, 0) + 1
    config = run.config
    selector = config.get("selector", "random")
    return {
        "run": run.id,
        "selector": selector,
        # random learns nothing, so it keeps no state
        "selection_key": None if selector == "random" else (config.get("selection-key")
                                                            or f"{selector}:{config.get('dataset')}:{config.get('model')}"),
        "round_deadline": config.get("round-deadline"),
        "over_selection": config.get("over-selection"),
        "policies": policies,
        "nodes": sorted(nodes.values(), key=lambda r: (-r["selected"], r["node_id"])),
        "rounds": [
            {"round": r.round, "policy": r.policy, "reward": r.reward, "chosen": len(r.choices),
             "late": sum(1 for o in r.outcomes.values() if o == "late"),
             "failed": sum(1 for o in r.outcomes.values() if o == "failed"),
             "agent_avg": r.details.get("agent-avg"), "heuristic_avg": r.details.get("heuristic-avg"),
             "seconds": r.details.get("round-seconds")}
            for r in records
        ],
    }


def model_view(version: ModelVersion, heads: dict[str, int]) -> dict[str, Any]:
    return {
        "version": version.id,
        "run": version.run_id,
        "round": version.round,
        "parent": version.parent_id,
        "architecture": version.architecture,
        "head": heads.get(version.architecture) == version.id,
        "sha256": version.sha256,
        "size_bytes": version.size_bytes,
        "metrics": version.metrics,
        "tags": version.tags,
        "path": version.path,
        "created_at": iso(version.created_at),
    }


def models_view(repo: Repository, *, run_id: int | None = None) -> list[dict[str, Any]]:
    heads = repo.heads()
    return [model_view(v, heads) for v in repo.list_model_versions(run_id=run_id)]


def export_model(repo: Repository, version_id: int, destination: Path) -> Path:
    """Copy a verified model version to ``destination`` (a file, or a folder to put it in)."""
    version = repo.get_model_version(version_id)
    from quorumfl.server.model_store import ModelStore  # numpy: only for this command

    ModelStore.load(version.path, version.sha256)  # refuses a tampered file
    target = destination / Path(version.path).name if destination.is_dir() else destination
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(version.path, tmp)
    tmp.replace(target)
    return target


def _error_classes(base: type[QuorumError] = QuorumError) -> dict[str, type[QuorumError]]:
    found = {base.__name__: base}
    for sub in base.__subclasses__():
        found.update(_error_classes(sub))
    return found


def run_outcome_error(run: Run) -> QuorumError | None:
    """None for a completed run; otherwise the error to exit with: ``RoundsLostError`` for a partial one;
    of the class the run failed with when that is a QuorumFL error (its exit code then says why), else
    ``FederationError``."""
    if run.status == RunStatus.COMPLETED:
        return None
    reason = run.error or "no reason was recorded"
    if run.status == RunStatus.PARTIAL:
        return RoundsLostError(f"run {run.id} ended partial: {reason}")
    name, _, _ = reason.partition(": ")
    kind = _error_classes().get(name, FederationError) if run.status == RunStatus.FAILED else FederationError
    return kind(f"run {run.id} {run.status}: {reason}")


def run_closing(repo: Repository, run: Run, elapsed: float) -> str:
    """The closing summary of a followed run: outcome, rounds, the last global metrics, node failures,
    the model version it produced."""
    summary = run_summary(repo, run)
    rounds = [r for r in run.rounds if r.status != RoundStatus.ABORTED]
    failures = sum(len(r.failures) for r in rounds)
    took_part = {n for r in rounds for n in r.participants}
    line = (f"run {run.id} {run.status} in {elapsed:.0f} s ({summary['privacy_label']}): "
            f"{summary['rounds_completed']}/{run.num_rounds} rounds, "
            f"{len(took_part)} node(s) took part, {failures} node failure(s)")
    if summary["stopped_early_after"] is not None:
        line += f" (stopped early: no better {summary['round_metric']} in {run.config.get('early-stop-patience')} rounds)"
    if summary["final_metric"] is not None:
        line += f"; {summary['round_metric']} {summary['final_metric']:.3f}"
    versions = repo.list_model_versions(run_id=run.id)
    if versions:
        line += f"; model version {versions[-1].id}"
    if run.error:
        line += f"; {run.error}"
    return line


def budget_view(ledger: Any, *, delta: float, budget: float | None) -> dict[str, Any]:
    """A department's privacy ledger for people and scripts: ε per run, the total, refusals."""
    runs = [{"run": r.run, "rounds": r.rounds, "epsilon": r.epsilon} for r in ledger.by_run(delta)]
    total = ledger.spent(delta)
    view: dict[str, Any] = {"delta": delta, "runs": runs, "total": total, "refusals": [
        {"run": r.run, "round": r.round, "epsilon_would_be": r.epsilon_would_be, "budget": r.budget,
         "reason": r.reason} for r in ledger.refusals()]}
    if budget is not None:
        view["budget"], view["left"] = budget, max(0.0, budget - total)
    return view
