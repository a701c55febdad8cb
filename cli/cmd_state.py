"""``quorumfl nodes …`` and ``quorumfl models …``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quorumfl.cli.context import settings
from quorumfl.cli.output import (
    Format,
    OpenOpt,
    OutOpt,
    ReportFormat,
    ReportFormatOpt,
    console,
    emit_report,
    print_json,
    short_time,
    table,
)
from quorumfl.core.metric_names import primary_among
from quorumfl.errors import ModelStoreError
from quorumfl.server.services import export_model, model_view, models_view, nodes_view

nodes_app = typer.Typer(help="Department nodes known to the server.", no_args_is_help=True)
models_app = typer.Typer(help="Model versions produced by rounds.", no_args_is_help=True)

FormatOpt = Annotated[Format, typer.Option("--format", help="Output format.")]
NodeRef = Annotated[str, typer.Argument(help="Flower node id or department name.")]


@nodes_app.command("list")
def list_nodes(
    ctx: typer.Context,
    run: Annotated[int | None, typer.Argument(help="A run (QuorumFL or Flower id): show only its nodes, with "
                                                  "their cluster and final accuracies.")] = None,
    fmt: FormatOpt = Format.TABLE,
) -> None:
    """Known nodes, their department and whether they may be selected (per run: cluster and accuracy)."""
    rows = nodes_view(settings(ctx).repository(), run)
    if fmt is Format.JSON:
        print_json(rows)
        return
    if run is None:
        for row in rows:
            row["first_seen"] = short_time(row["first_seen"])
            row["last_seen"] = short_time(row["last_seen"]) or "not yet"  # registered, never connected
        console.print(table("Nodes", rows, ["node_id", "department", "enabled", "last_seen", "first_seen"],
                            optional=["first_seen", "last_seen"]))
        return
    primary = primary_among(name for r in rows for name in r)
    columns = ["node_id", "department", "enabled"] + [
        c for c in ("cluster", primary, f"personal-{primary}") if any(c in r for r in rows)
    ]
    console.print(table(f"Nodes of run {run}", rows, columns))


def _set_enabled(ctx: typer.Context, ref: str, enabled: bool) -> None:
    nodes = settings(ctx).repository().set_enabled(ref, enabled)
    word = "enabled" if enabled else "disabled (never selected)"
    for node in nodes:
        console.print(f"node {node.node_id} ({node.department}) {word}")


@nodes_app.command("report")
def report(
    ctx: typer.Context,
    department: Annotated[str, typer.Argument(help="Department name (or one of its node ids).")],
    out: OutOpt = Path("."),
    fmt: ReportFormatOpt = ReportFormat.HTML,
    open_page: OpenOpt = False,
) -> None:
    """A department's record for its data-protection officer: every run and round it took part in, the
    secure mode and threshold, ε spent against its budget, the model versions made from its updates and
    where they were published to edge devices."""
    from quorumfl.server.department_record import department_record, render_department_html

    data = department_record(settings(ctx).repository(), department)
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(data["department"]))
    emit_report(data, fmt, out, f"department-{safe}.html", lambda: render_department_html(data), open_page=open_page)


@nodes_app.command("disable")
def disable(ctx: typer.Context, node: NodeRef) -> None:
    """Never select this node (by id, or every node of a department) until enabled again."""
    _set_enabled(ctx, node, False)


@nodes_app.command("enable")
def enable(ctx: typer.Context, node: NodeRef) -> None:
    """Allow a disabled node to be selected again."""
    _set_enabled(ctx, node, True)


@models_app.command("list")
def list_models(
    ctx: typer.Context,
    run: Annotated[int | None, typer.Option(help="Only versions of this run.")] = None,
    fmt: FormatOpt = Format.TABLE,
) -> None:
    """Model versions; 'head' marks the one the next round of its architecture starts from."""
    repo = settings(ctx).repository()
    run_id = repo.get_run(run).id if run is not None else None
    rows = models_view(repo, run_id=run_id)
    if fmt is Format.JSON:
        print_json(rows)
        return
    for row in rows:
        primary = primary_among(row["metrics"])
        row["metric"] = f"{primary} {row['metrics'][primary]:.3f}" if primary in row["metrics"] else None
        row["sha"] = row["sha256"][:12]
    console.print(table("Model versions", rows, ["version", "run", "round", "head", "metric", "parent", "architecture",
                                                 "sha"], optional=["parent", "sha"]))


@models_app.command("show")
def show_model(ctx: typer.Context, version: Annotated[int, typer.Argument(help="Model version id.")], fmt: FormatOpt = Format.TABLE) -> None:
    """One model version with its hash, file and metrics; its file is checked against the hash (exit
    7 when it is missing or was modified)."""
    repo = settings(ctx).repository()
    record = repo.get_model_version(version)
    view = model_view(record, repo.heads())
    from quorumfl.server.model_store import ModelStore

    problem: ModelStoreError | None = None
    try:
        ModelStore.load(record.path, record.sha256)
    except ModelStoreError as exc:
        problem = exc
    view["file_ok"] = problem is None
    if fmt is Format.JSON:
        print_json(view)
    else:
        for key, value in view.items():
            shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items()) \
                if isinstance(value, dict) else value
            console.print(f"[bold]{key}[/bold]: {shown}", highlight=False)
    if problem is not None:
        raise problem


@models_app.command("export")
def export(
    ctx: typer.Context,
    version: Annotated[int, typer.Argument(help="Model version id.")],
    out: Annotated[Path, typer.Option(help="Target file, or an existing folder.")],
) -> None:
    """Copy a model version's .npz (verified against its SHA-256) to OUT."""
    target = export_model(settings(ctx).repository(), version, out)
    console.print(f"model version {version} written to {target}")


@models_app.command("rollback")
def rollback(ctx: typer.Context, version: Annotated[int, typer.Argument(help="Model version id.")]) -> None:
    """Make VERSION the head of its architecture: the next round starts from it."""
    repo = settings(ctx).repository()
    chosen = repo.get_model_version(version)
    from quorumfl.server.model_store import ModelStore

    ModelStore.load(chosen.path, chosen.sha256)  # never point the head at a damaged file
    repo.rollback(version)
    console.print(f"head of {chosen.architecture} is now version {version} (run {chosen.run_id}, round {chosen.round})")
