"""Run reports: everything the state DB holds about one run, as one JSON-able dict and as one
self-contained HTML page (``quorumfl runs report``).

``report_data`` reads the run, its rounds, failures, metrics and model versions and arranges them
per round and per department; ``render_html`` draws the figures with matplotlib (Agg, PNG embedded
as base64: no network, no CDN, opens offline) beside tables of the same numbers. The HTML is
rendered from the dict alone, so the page and ``--format json`` cannot disagree.

What a participation cell means, from the round's participants and its failure records:
``trained`` (its update was aggregated), ``late`` (over-selection cut or round deadline),
``rejected`` (the server refused its update: invalid, or answering no request), ``refused`` (the
node refused the round, e.g. past its privacy budget), ``dropped`` (any other failure: no reply, an
error on the node, a secure-aggregation stage it did not complete), and no
entry when the node was not selected.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Iterable
from typing import Any

from quorumfl.errors import ConfigError
from quorumfl.server.joining import alone_sentence, compare_alone
from quorumfl.server.pages import figure, page, png, table, whole_rounds
from quorumfl.server.services import (
    department_columns,
    department_finals,
    round_metric,
    run_summary,
)
from quorumfl.server.state.orm import Metric, ModelVersion, Round
from quorumfl.server.state.repository import Repository, RoundStatus

__all__ = ["PARTICIPATION", "compare_data", "participation_state", "render_compare_html",
           "render_html", "report_data"]

# Participation states in the order the map's colour scale uses them.
PARTICIPATION = ("trained", "late", "rejected", "refused", "dropped")
NOT_STAGES = frozenset({"local_train_max"})  # timings that are not a stage of the round's wall time


def participation_state(stage: str, reason: str) -> str:
    """A failure record's participation state (see the module docstring)."""
    if stage in ("late", "deadline"):
        return "late"
    if stage in ("rejected", "aggregate"):  # the server refused the update (invalid, or answered no request)
        return "rejected"
    if stage == "dp-budget" or reason.startswith("refused"):
        return "refused"
    return "dropped"


def _last_attempts(rounds: Iterable[Round]) -> dict[int, Round]:
    """Each round number's last attempt (an aborted attempt is replaced by its redo)."""
    last: dict[int, Round] = {}
    for rnd in rounds:
        if rnd.number not in last or rnd.attempt >= last[rnd.number].attempt:
            last[rnd.number] = rnd
    return last


def _versions(versions: list[ModelVersion]) -> list[dict[str, Any]]:
    """The run's model versions; ``rollback`` names the version a round started from when that was
    not the version the round before produced in the same lineage (an admin rolled the head back)."""
    by_id = {v.id: v for v in versions}
    rows = []
    for v in sorted(versions, key=lambda v: v.id):
        parent = by_id.get(v.parent_id) if v.parent_id is not None else None
        rolled = parent is not None and parent.round < v.round - 1
        rows.append({"version": v.id, "round": v.round, "parent": v.parent_id, "architecture": v.architecture,
                     "metrics": dict(v.metrics), "tags": list(v.tags), "size_bytes": v.size_bytes,
                     "rollback_to": v.parent_id if rolled else None})
    return rows


def _per_node(metrics: list[Metric], name: str) -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = {}
    for m in metrics:
        if m.node_id is not None and m.name == name:
            out.setdefault(m.round, {})[m.node_id] = m.value
    return out


def _monitoring(metrics: list[Metric], name: Callable[[int], str]) -> list[dict[str, Any]]:
    """Plaintext rounds' update monitoring: per round and department, the update's norm, its cosine to
    the round's change, and whether it was flagged (``aggregation.monitor``)."""
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    keys = {"update-norm": "norm", "update-cosine": "cosine", "update-flagged": "flagged"}
    for m in metrics:
        if m.node_id is not None and m.name in keys:
            row = rows.setdefault((m.round, m.node_id), {"round": m.round, "department": name(m.node_id)})
            row[keys[m.name]] = bool(m.value) if m.name == "update-flagged" else m.value
    return [rows[k] for k in sorted(rows)]


def _histograms(global_metrics: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    """Secure rounds' revealed histograms: per round, nodes per norm and per loss bucket (by the bucket's
    lower edge; ``aggregation.secagg.payload``), and how many stood out."""
    from quorumfl.aggregation.secagg.payload import LOSS_EDGES, NORM_EDGES

    rows = []
    for number, values in sorted(global_metrics.items()):
        row: dict[str, Any] = {"round": number, "flagged": values.get("flagged-nodes")}
        for kind, edges in (("norm", NORM_EDGES), ("loss", LOSS_EDGES)):
            prefix = f"{kind}-histogram-"
            row[kind] = {(f"≥{edges[int(k[len(prefix):]) - 1]:.3g}" if int(k[len(prefix):]) else f"<{edges[0]:.3g}"): v
                         for k, v in sorted(values.items()) if k.startswith(prefix)}
        if row["norm"] or row["loss"]:
            rows.append(row)
    return rows


def report_data(repo: Repository, ref: int) -> dict[str, Any]:
    """The report of run ``ref`` (QuorumFL or Flower id) as plain JSON-able data."""
    run = repo.get_run(ref)
    names = {n.node_id: n.department for n in repo.list_nodes()}
    metrics = repo.metrics(run.id)
    summary = run_summary(repo, run)
    primary = str(summary["primary_metric"])

    def name(node: int) -> str:
        return names.get(node) or str(node)

    global_metrics: dict[int, dict[str, float]] = {}
    final: dict[str, float] = {}  # the final model as the departments measured it (example-weighted)
    for m in metrics:
        if m.node_id is None and m.name.startswith("final-"):
            final[m.name] = m.value
        elif m.node_id is None:
            global_metrics.setdefault(m.round, {})[m.name] = m.value
    uplink = _per_node(metrics, "uplink-bytes")
    rounds = []
    for rnd in run.rounds:
        aborted = rnd.status == RoundStatus.ABORTED
        up = uplink.get(rnd.number, {}) if not aborted else {}
        rounds.append({
            "round": rnd.number, "attempt": rnd.attempt, "status": rnd.status,
            "selected": [name(n) for n in rnd.selected], "participants": [name(n) for n in rnd.participants],
            "stages_s": {k: v for k, v in rnd.timings.items() if k not in NOT_STAGES},
            "slowest_training_s": rnd.timings.get("local_train_max"),
            "metrics": global_metrics.get(rnd.number, {}) if not aborted else {},
            "uplink_bytes": sum(up.values()) if up else None,
            "downlink_bytes": global_metrics.get(rnd.number, {}).get("downlink-bytes") if not aborted else None,
            "failures": [{"node": name(f.node_id), "stage": f.stage, "reason": f.reason,
                          "state": participation_state(f.stage, f.reason)} for f in rnd.failures],
        })

    cells: dict[str, dict[str, str]] = {}
    for number, rnd in sorted(_last_attempts(run.rounds).items()):
        for node in rnd.selected:
            cells.setdefault(name(node), {})[str(number)] = "selected"
        for node in rnd.participants:
            cells.setdefault(name(node), {})[str(number)] = "trained"
        for f in rnd.failures:
            cells.setdefault(name(f.node_id), {})[str(number)] = participation_state(f.stage, f.reason)
    cells = {node: {r: s for r, s in row.items() if s != "selected"} for node, row in sorted(cells.items())}

    finals = compare_alone(department_finals(metrics, names), primary)
    epsilon, budget = _per_node(metrics, "dp-epsilon"), _per_node(metrics, "dp-budget")
    privacy: dict[str, dict[str, Any]] = {}
    for number in sorted(epsilon):
        for node, value in epsilon[number].items():
            privacy[name(node)] = {"department": name(node), "round": number, "epsilon": value,
                                   "budget": budget.get(number, {}).get(node)}
    federation_epsilon = {str(r): v["dp-federation-epsilon"] for r, v in sorted(global_metrics.items())
                          if "dp-federation-epsilon" in v}
    return {
        "run": summary,
        "config": run.config,
        "primary_metric": primary,
        "round_metric": round_metric(primary, [m.name for m in metrics if m.node_id is None]),
        "rounds": rounds,
        "participation": {"rounds": sorted(_last_attempts(run.rounds)), "nodes": cells},
        "departments": finals,
        "joining": alone_sentence(finals, primary),
        "final": final,
        "privacy": sorted(privacy.values(), key=lambda p: str(p["department"])),
        "federation_epsilon": federation_epsilon,
        "monitoring": _monitoring(metrics, name),
        "histograms": _histograms(global_metrics),
        "versions": _versions(repo.list_model_versions(run_id=run.id)),
    }


# ---- HTML ----------------------------------------------------------------------------------------

def _completed(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in data["rounds"] if r["status"] == RoundStatus.COMPLETED]


def _metric_figure(data: dict[str, Any]) -> str:
    rounds = _completed(data)
    fig, (top, bottom) = figure(2, 1, figsize=(7, 5), sharex=True)
    primary, shown = data["primary_metric"], data["round_metric"]
    series = sorted({k for r in rounds for k in r["metrics"]
                     if k in (shown, f"federated-{primary}") or k.startswith(f"{primary}-cluster-")})
    for key in series:
        points = [(r["round"], r["metrics"][key]) for r in rounds if key in r["metrics"]]
        top.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key)
    top.set_ylabel(primary)
    for key in ("loss", "federated-loss", "train-loss"):
        points = [(r["round"], r["metrics"][key]) for r in rounds if key in r["metrics"]]
        if points:
            bottom.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=key)
    return _metric_and_loss_png(fig, top, bottom)


def _metric_and_loss_png(fig: Any, top: Any, bottom: Any) -> str:
    """The metric-over-loss figure finished: loss axis labelled, whole rounds, legends, as PNG."""
    bottom.set_ylabel("loss")
    bottom.set_xlabel("round")
    whole_rounds(bottom)
    for axis in (top, bottom):
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    return png(fig)


def _stage_figure(data: dict[str, Any]) -> str:
    rounds = _completed(data)
    stages = list(dict.fromkeys(k for r in rounds for k in r["stages_s"]))
    fig, axis = figure(figsize=(7, 3))
    bottom = [0.0] * len(rounds)
    for stage in stages:
        values = [r["stages_s"].get(stage, 0.0) for r in rounds]
        axis.bar([r["round"] for r in rounds], values, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axis.set_xlabel("round")
    axis.set_ylabel("seconds")
    whole_rounds(axis)
    if stages:
        axis.legend(fontsize=8, ncol=3)
    return png(fig)


def _participation_figure(data: dict[str, Any]) -> str:
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    numbers = data["participation"]["rounds"]
    nodes = list(data["participation"]["nodes"])
    colours = ["#2e7d32", "#f9a825", "#c62828", "#6a1b9a", "#757575"]
    grid = [[float("nan")] * len(numbers) for _ in nodes]
    for i, node in enumerate(nodes):
        for j, number in enumerate(numbers):
            state = data["participation"]["nodes"][node].get(str(number))
            if state is not None:
                grid[i][j] = float(PARTICIPATION.index(state))
    fig, axis = figure(figsize=(7, 0.4 * len(nodes) + 1.2))
    axis.imshow(grid, cmap=ListedColormap(colours), vmin=0, vmax=len(colours) - 1, aspect="auto")
    axis.set_yticks(range(len(nodes)), nodes)
    axis.set_xticks(range(len(numbers)), [str(n) for n in numbers])
    axis.set_xlabel("round (blank: not selected)")
    axis.legend(handles=[Patch(color=c, label=s) for c, s in zip(colours, PARTICIPATION, strict=True)],
                fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return png(fig)


def _bytes_figure(data: dict[str, Any]) -> str:
    rounds = _completed(data)
    fig, axis = figure(figsize=(7, 3))
    xs = [r["round"] for r in rounds]
    axis.bar([x - 0.2 for x in xs], [(r["uplink_bytes"] or 0) / 1e6 for r in rounds], width=0.4, label="up (nodes → server)")
    axis.bar([x + 0.2 for x in xs], [(r["downlink_bytes"] or 0) / 1e6 for r in rounds], width=0.4, label="down (server → nodes)")
    axis.set_xlabel("round")
    axis.set_ylabel("MB of arrays")
    whole_rounds(axis)
    axis.legend(fontsize=8)
    return png(fig)


def _monitoring_section(data: dict[str, Any]) -> str:
    rows = data["monitoring"]
    if not rows and data["histograms"]:
        return ("<p>A secure run: the server saw no single update, only each round's histograms of the nodes' "
                "update norms and train losses (nodes per half-decade bucket), summed with the updates. "
                "<em>flagged</em> counts nodes two or more buckets above the median.</p>"
                + table(data["histograms"], ["round", "flagged", "norm", "loss"]))
    if not rows:
        return "<p>No per-update figures were recorded in this run.</p>"
    fig, axis = figure(figsize=(7, 3))
    for department in sorted({r["department"] for r in rows}):
        points = [(r["round"], r["norm"]) for r in rows if r["department"] == department and "norm" in r]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=department)
    flagged = [(r["round"], r["norm"]) for r in rows if r.get("flagged") and "norm" in r]
    if flagged:
        axis.scatter([p[0] for p in flagged], [p[1] for p in flagged], s=160, facecolors="none", edgecolors="red",
                     label="flagged")
    axis.set_yscale("log")
    axis.set_xlabel("round")
    axis.set_ylabel("‖update − model‖")
    whole_rounds(axis)
    axis.legend(fontsize=7, ncol=2)
    marked = [r for r in rows if r.get("flagged")]
    return png(fig) + (table(marked, ["round", "department", "norm", "cosine"]) if marked
                       else "<p>No update stood out (norm, cosine to the round's change, loss).</p>")


def _privacy_figure(data: dict[str, Any]) -> str:
    rows = data["privacy"]
    fig, axis = figure(figsize=(7, 0.4 * len(rows) + 1.2))
    axis.barh([r["department"] for r in rows], [r["epsilon"] for r in rows], label="ε spent")
    budgets = [(i, r["budget"]) for i, r in enumerate(rows) if r["budget"] is not None]
    if budgets:
        axis.scatter([b for _, b in budgets], [i for i, _ in budgets], marker="|", s=400, color="black", label="budget")
    axis.set_xlabel("ε (all runs, as each department's ledger counts it)")
    axis.legend(fontsize=8)
    return png(fig)


def render_html(data: dict[str, Any]) -> str:
    """The report page for ``report_data``'s dict: one file, figures embedded."""
    run = data["run"]
    primary = data["primary_metric"]
    title = (f"QuorumFL run {run['id']}: {run['status']}, {run['secure_aggregation']}, {run['strategy']}, "
             f"{run['rounds_completed']}/{run['rounds_planned']} rounds")
    round_rows = [{**r, **{k: v for k, v in r["metrics"].items()},
                   "seconds": round(sum(r["stages_s"].values()), 2), "failures": len(r["failures"])} for r in data["rounds"]]
    metric_keys = list(dict.fromkeys(k for r in data["rounds"] for k in r["metrics"]
                                     if not k.startswith(("norm-histogram-", "loss-histogram-"))))
    failures = [{"round": r["round"], **f} for r in data["rounds"] for f in r["failures"]]
    dept_columns = department_columns(data["departments"], primary)
    sections = [
        ("summary", "Run", f"<p><strong>{html.escape(run['task'])}</strong>. {html.escape(run['privacy'])}.</p>"
         + table([run], ["id", "status", "secure_aggregation", "dp", "threshold", "strategy", "task",
                         "rounds_completed", "rounds_planned", "round_metric", "final_metric", "started_at",
                         "finished_at", "error"])),
        ("metric", f"{primary} and loss per round", _metric_figure(data)
         + table(round_rows, ["round", "attempt", "status", *metric_keys, "seconds", "failures"])),
        ("departments", "Each department's final model", table(data["departments"], dept_columns)
         + (f"<p>{html.escape(data['joining'])}</p>" if data.get("joining") else "")),
        ("stages", "Time per round by stage", _stage_figure(data)),
        ("participation", "Who took part", _participation_figure(data)
         + (table(failures, ["round", "node", "state", "stage", "reason"]) if failures
            else "<p>Every selected department took part in every round.</p>")),
        ("bytes", "Bytes per round", _bytes_figure(data)
         + table(round_rows, ["round", "attempt", "uplink_bytes", "downlink_bytes"])),
        ("privacy", "Privacy budget (ε)", (_privacy_figure(data) if data["privacy"] else "<p>No department reported a "
                                           "differentially private round in this run.</p>")
         + (table(data["privacy"], ["department", "round", "epsilon", "budget"]) if data["privacy"] else "")),
        ("monitoring", "Update monitoring", _monitoring_section(data)),
        ("versions", "Model versions", table(data["versions"], ["version", "round", "parent", "rollback_to",
                                                                 "architecture", "metrics", "tags", "size_bytes"])),
    ]
    return page(title, sections)


# ---- several runs --------------------------------------------------------------------------------

def compare_data(repo: Repository, refs: list[int]) -> dict[str, Any]:
    """Each run's report, and the run-config keys whose values differ between them."""
    if len(refs) < 2:
        raise ConfigError(f"runs compare needs at least two runs, got {len(refs)}; give more run ids")
    reports = [report_data(repo, ref) for ref in refs]
    ids = [r["run"]["id"] for r in reports]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"runs compare got the same run twice ({', '.join(map(str, refs))}); give distinct runs")
    keys = sorted({k for r in reports for k in r["config"]})
    differ = {k: [r["config"].get(k) for r in reports] for k in keys
              if len({json.dumps(r["config"].get(k), sort_keys=True) for r in reports}) > 1}
    return {"runs": reports, "config_differences": differ}


def _overlay_figure(data: dict[str, Any]) -> str:
    fig, (top, bottom) = figure(2, 1, figsize=(7, 5), sharex=True)
    for report in data["runs"]:
        rounds, label = _completed(report), f"run {report['run']['id']} ({report['run']['strategy']})"
        for axis, key in ((top, report["round_metric"]), (bottom, "loss" if report["round_metric"] == report["primary_metric"]
                                                             else "train-loss")):
            points = [(r["round"], r["metrics"][key]) for r in rounds if key in r["metrics"]]
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{label}: {key}")
    top.set_ylabel(data["runs"][0]["primary_metric"])
    return _metric_and_loss_png(fig, top, bottom)


def render_compare_html(data: dict[str, Any]) -> str:
    """One page overlaying ``compare_data``'s runs: metric and loss per round, summaries, what differs."""
    ids = [str(r["run"]["id"]) for r in data["runs"]]
    title = f"QuorumFL runs {', '.join(ids)} compared"
    summaries = [{**r["run"], "seconds": round(sum(sum(x["stages_s"].values()) for x in r["rounds"]), 2)}
                 for r in data["runs"]]
    differ = [{"key": k, **{f"run {i}": v for i, v in zip(ids, values, strict=True)}}
              for k, values in data["config_differences"].items()]
    sections = [
        ("metric", "Metric and loss per round", _overlay_figure(data)),
        ("summary", "Runs", table(summaries, ["id", "status", "strategy", "rounds_completed", "round_metric",
                                               "final_metric", "seconds", "started_at"])),
        ("config", "Run-config keys that differ", table(differ, ["key", *[f"run {i}" for i in ids]]) if differ
         else "<p>The runs share every run-config key.</p>"),
    ]
    return page(title, sections)
