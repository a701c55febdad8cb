"""One department's record for its data-protection officer (GDPR accountability), from the state DB:
``quorumfl nodes report DEPARTMENT`` (HTML or JSON).

Every run and round the department's nodes took part in or failed in, the secure mode and threshold
of each run, the ε its ledger reported against its budget, the model versions made in the rounds it
took part in and every version derived from them later (by lineage), and the edge publications of
any of those versions."""

from __future__ import annotations

import html
from typing import Any

from quorumfl.server.pages import page, table
from quorumfl.server.report import participation_state
from quorumfl.server.state.artifacts import ArtifactRecords
from quorumfl.server.state.repository import Repository, RoundStatus

__all__ = ["department_record", "render_department_html"]


def department_record(repo: Repository, ref: str) -> dict[str, Any]:
    """What a department's data-protection officer needs (GDPR accountability): every run and round its
    nodes took part in, under which secure mode and threshold, the ε its ledger reported against its
    budget, the model versions its updates went into (those rounds' versions and every version derived
    from them), and where those were published to edge devices. ``ref``: department name or node id."""
    nodes = repo.find_nodes(ref)
    ids = {n.node_id for n in nodes}
    department = nodes[0].department or ref
    runs = []
    contributed: set[int] = set()
    versions = repo.list_model_versions()
    by_run_round: dict[tuple[int | None, int], list[int]] = {}
    for v in versions:
        by_run_round.setdefault((v.run_id, v.round), []).append(v.id)
    for listed in repo.list_runs():
        run = repo.get_run(listed.id)  # with its rounds' failures
        metrics = repo.metrics(run.id)
        epsilon = {m.round: m.value for m in metrics if m.node_id in ids and m.name == "dp-epsilon"}
        budget = {m.round: m.value for m in metrics if m.node_id in ids and m.name == "dp-budget"}
        rounds = []
        for rnd in sorted(run.rounds, key=lambda r: (r.number, r.attempt)):
            took_part = ids & set(rnd.participants)
            failed = [f for f in rnd.failures if f.node_id in ids]
            if not took_part and not failed:
                continue
            made = by_run_round.get((run.id, rnd.number), []) if took_part and rnd.status == RoundStatus.COMPLETED else []
            contributed.update(made)
            rounds.append({"round": rnd.number, "attempt": rnd.attempt, "status": rnd.status,
                           "took_part": bool(took_part), "model_versions": made,
                           "failures": [{"stage": f.stage, "reason": f.reason,
                                         "state": participation_state(f.stage, f.reason)} for f in failed],
                           "epsilon": epsilon.get(rnd.number), "budget": budget.get(rnd.number)})
        if rounds:
            config = run.config
            runs.append({"run": run.id, "status": run.status, "strategy": run.strategy,
                         "secure_aggregation": config.get("secure-aggregation", "none"),
                         "threshold": config.get("secagg-threshold"), "dp": config.get("dp", "none"),
                         "started_at": run.started_at.isoformat(timespec="seconds") if run.started_at else None,
                         "rounds": rounds})
    derived = set(contributed)
    for v in sorted(versions, key=lambda v: v.id):  # parents come before their children
        if v.parent_id in derived:
            derived.add(v.id)
    published = [{"edge_version": a.version, "channel": a.channel, "format": a.format, "model_version": a.model_version_id,
                  "sha256": a.sha256, "published_at": a.created_at.isoformat(timespec="seconds")}
                 for a in ArtifactRecords(repo.sessions).list() if a.model_version_id in derived]
    spent = [r["epsilon"] for run in runs for r in run["rounds"] if r["epsilon"] is not None]
    budgets = [r["budget"] for run in runs for r in run["rounds"] if r["budget"] is not None]
    return {"department": department, "node_ids": sorted(str(i) for i in ids), "runs": runs,
            "epsilon_spent": max(spent) if spent else None, "budget": budgets[-1] if budgets else None,
            "contributed_versions": sorted(contributed), "derived_versions": sorted(derived - contributed),
            "published": published}


def render_department_html(data: dict[str, Any]) -> str:
    """The department record as one page: runs and rounds, ε, model versions and edge publications."""
    rows = [{"run": run["run"], "strategy": run["strategy"], "secure aggregation": run["secure_aggregation"],
             "threshold": run["threshold"], "dp": run["dp"], **r, "failures": [f["state"] + ": " + f["reason"] for f in r["failures"]]}
            for run in data["runs"] for r in run["rounds"]]
    summary = {"department": data["department"], "node ids": data["node_ids"], "runs": len(data["runs"]),
               "rounds taken part in": sum(r["took_part"] for r in rows), "ε spent": data["epsilon_spent"],
               "ε budget": data["budget"]}
    sections = [
        ("summary", "Department", table([summary], list(summary))),
        ("rounds", "Runs and rounds", table(rows, ["run", "strategy", "secure aggregation", "threshold", "dp", "round",
                                                    "attempt", "status", "took_part", "model_versions", "epsilon",
                                                    "budget", "failures"])),
        ("versions", "Model versions from its updates",
         f"<p>Made in rounds it took part in: {html.escape(', '.join(map(str, data['contributed_versions'])) or 'none')}. "
         f"Derived from those later: {html.escape(', '.join(map(str, data['derived_versions'])) or 'none')}.</p>"),
        ("published", "Published to edge devices", table(data["published"], ["edge_version", "channel", "format",
                                                                              "model_version", "sha256", "published_at"])
         if data["published"] else "<p>None of these versions was published to edge devices.</p>"),
    ]
    return page(f"QuorumFL department record: {data['department']}", sections)
