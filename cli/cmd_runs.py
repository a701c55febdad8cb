"""``quorumfl runs …`` and ``quorumfl rounds …``."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from quorumfl.cli.context import DEFAULT_SUPERLINK, settings
from quorumfl.cli.output import (
    Format,
    OpenOpt,
    OutOpt,
    ReportFormat,
    ReportFormatOpt,
    console,
    emit_report,
    err_console,
    print_json,
    short_time,
    table,
)
from quorumfl.core.metric_names import primary_among
from quorumfl.errors import ConfigError, FederationError, NotFoundError, StateError
from quorumfl.server.joining import GAIN
from quorumfl.server.run_summary import round_metric, run_summaries

if TYPE_CHECKING:  # rich.progress, the ORM and the views over it, secrets and tomllib load only for
    # the commands that use them: 'runs list' starts faster without them
    from rich.progress import Progress

    from quorumfl.server.state.orm import Round, Run
    from quorumfl.server.state.repository import Repository

# left out, last first, where a department table does not fit: the verdict and the figures stay
DEPARTMENT_OPTIONAL = [GAIN, "cluster", "loss", "num-examples"]

runs_app = typer.Typer(help="Start, follow, inspect and stop federated training runs.", no_args_is_help=True)
rounds_app = typer.Typer(help="Inspect the rounds of a run.", no_args_is_help=True)

FormatOpt = Annotated[Format, typer.Option("--format", help="Output format.")]
SuperlinkOpt = Annotated[str, typer.Option("--superlink", help="SuperLink address HOST:PORT (Control API).")]
InsecureOpt = Annotated[bool, typer.Option("--insecure", help="The SuperLink runs without TLS (warns).")]
CaCertOpt = Annotated[Path | None, typer.Option("--ca-cert", help="Federation CA certificate (default HOME/certs/ca.crt).")]


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key=value (e.g. -c num-rounds=10)")
    import tomllib

    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string
    return key.strip(), value


def round_progress(total: int) -> tuple[Progress, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        # The stage line last, so that on a narrow terminal it is what gets cut, not the count or time.
        TextColumn("[bold]rounds"), BarColumn(bar_width=12), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), TextColumn("{task.description}"), console=console,
    )
    task = progress.add_task("", total=total)
    return progress, task


def round_reporter(repo: Repository, progress: Progress, task: Any) -> Callable[[Run, Round], None]:
    """A ``follow_run`` callback that prints each finished round as a line and advances the bar."""

    def on_round(run: Run, rnd: Round) -> None:
        values = {m.name: m.value for m in repo.metrics(run.id) if m.round == rnd.number and m.node_id is None}
        name = round_metric(primary_among(values), values)
        acc = f"{name} {values[name]:.3f}" if name in values else rnd.status
        failed = f", {len(rnd.failures)} node failure(s)" if rnd.failures else ""
        took = f" in {(rnd.finished_at - rnd.started_at).total_seconds():.0f} s" if rnd.finished_at else ""
        progress.console.print(f"round {rnd.number}: {acc}, {len(rnd.participants)} nodes{failed}{took}", highlight=False)
        progress.update(task, advance=1, description="")

    return on_round


def stage_reporter(progress: Progress, task: Any) -> Callable[[Run, Round], None]:
    """A ``follow_run`` ``on_progress`` callback: the running round's stage and nodes beside the bar."""
    from quorumfl.server.services import progress_line


    def on_progress(_run: Run, rnd: Round) -> None:
        progress.update(task, description=progress_line(rnd))

    return on_progress


def print_finished_run(repo: Repository, run: Run, began: float, *, label: str = "",
                       department_limit: int | None = None) -> None:
    """A finished run's global model per round, each department's final model (up to
    ``department_limit`` of them) and the closing line; a run that did not complete raises."""
    from quorumfl.server.services import (
        department_columns,
        run_closing,
        run_outcome_error,
        run_view,
    )

    view = run_view(repo, run.id)
    metric = view["round_metric"]
    rows = [{"round": r["round"], "status": r["status"], metric: r["metrics"].get(metric),
             "nodes": len(r["participants"]), "failures": len(r["failures"])} for r in view["rounds"]]
    console.print(table(f"Run {view['id']}{label}: global model per round ({metric})", rows,
                        ["round", "status", metric, "nodes", "failures"]))
    departments = view["departments"]
    if department_limit is None or len(departments) <= department_limit:
        console.print(table("Final model per department (own test split)", departments,
                            [c for c in department_columns(departments, view["primary_metric"]) if c != "loss"],
                            optional=DEPARTMENT_OPTIONAL))
        if view["joining"]:
            console.print(view["joining"], highlight=False)
    closing = run_closing(repo, run, time.monotonic() - began)
    failure = run_outcome_error(run)
    if failure is not None:  # partial: exit 12; failed or stopped: the class it failed with
        raise type(failure)(closing)
    console.print(f"[green]{closing}[/green]; see it again with 'quorumfl runs show {run.id}'", highlight=False)


@runs_app.command("start")
def start(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(
        help="Run config TOML (keys of [tool.flwr.app.config], top level or [run]); none: the defaults and -c.")] = None,
    override: Annotated[list[str] | None, typer.Option("-c", "--config-override", help="key=value, repeatable.")] = None,
    superlink: SuperlinkOpt = DEFAULT_SUPERLINK,
    follow: Annotated[bool, typer.Option(help="Show progress until the run ends.")] = False,
    timeout: Annotated[float, typer.Option(help="With --follow: give up after this many seconds.")] = 3600.0,
    insecure: InsecureOpt = False,
    ca_cert: CaCertOpt = None,
) -> None:
    """Submit a run of the QuorumFL app to the SuperLink (as `flwr run` does)."""
    import secrets

    from quorumfl.server.config import RunConfig, load_run_config_file
    from quorumfl.server.run_task import inline_schema

    values = load_run_config_file(config) if config is not None else {}
    values.update(dict(parse_override(o) for o in override or []))
    if "seed" not in values:  # a new run starts from new weights and a new sampling unless a seed is given
        values["seed"] = secrets.randbelow(2**31)
    resolved = RunConfig.from_mapping(values)
    if resolved.task_schema and not resolved.task_schema.lstrip().startswith("{"):
        values["task-schema"] = inline_schema(Path(resolved.task_schema))  # the server need not share our files
    control = settings(ctx).control(superlink, insecure=insecure, ca_cert=ca_cert)
    flower_run_id = control.start_run(values)
    recorded = _recorded_run(ctx, flower_run_id)
    shown = f"run {recorded} (Flower run {flower_run_id})" if recorded else f"Flower run {flower_run_id}"
    from quorumfl.server.run_labels import privacy_view, task_label

    stored = resolved.resolved()
    rounds = f"up to {resolved.num_rounds}" if resolved.early_stop_patience else str(resolved.num_rounds)
    console.print(f"[green]started {shown}[/green]: {resolved.strategy}, {rounds} rounds, "
                  f"{task_label(stored)}, seed {resolved.seed}; {privacy_view(stored)['sentence']}. 'runs show' and "
                  "'runs stop' take either id", highlight=False)
    if follow:
        _follow(ctx, control, flower_run_id, recorded or flower_run_id, resolved.num_rounds, timeout)


def _follow(ctx: typer.Context, control: Any, flower_run_id: int, ref: int, rounds: int, timeout: float) -> None:
    """Show the run's rounds until it ends; exit with the code of what it ended with (``ref``: the
    run's number, as messages name it)."""
    from quorumfl.server.services import (
        department_columns,
        follow_run,
        run_closing,
        run_outcome_error,
        run_view,
    )

    repo = settings(ctx).repository()
    progress, task = round_progress(rounds)
    began = time.monotonic()

    def alive() -> bool:
        try:
            return not control.run_finished(flower_run_id)
        except FederationError as exc:
            raise FederationError(
                f"the server went away while run {ref} was running ({exc}); the run stays running in the state DB, "
                f"and 'quorumfl server start' resumes it from its last completed round; follow it again with "
                f"'quorumfl runs show {ref}'") from exc

    try:
        with progress:
            run = follow_run(repo, flower_run_id, timeout=timeout, on_round=round_reporter(repo, progress, task),
                             alive=alive, on_progress=stage_reporter(progress, task))
    except KeyboardInterrupt:  # only the following stops: say so, and how to stop the run itself
        err_console.print(f"stopped following; run {ref} goes on at the server: 'quorumfl runs show {ref}' shows it, "
                          f"'quorumfl runs stop {ref}' stops it")
        raise
    view = run_view(repo, run.id)
    if view["departments"]:
        console.print(table("Final models per department (own test split)", view["departments"],
                            department_columns(view["departments"], view["primary_metric"])))
    console.print(run_closing(repo, run, time.monotonic() - began), highlight=False)
    failure = run_outcome_error(run)
    if failure is not None:  # a script must tell a failed run from a completed one
        raise failure


def _recorded_run(ctx: typer.Context, flower_run_id: int, wait: float = 20.0) -> int | None:
    """QuorumFL's id of a just-started run, once its ServerApp has recorded it in the state DB (None
    when this machine has no state DB, or the run is not recorded within ``wait`` seconds)."""
    try:
        repo = settings(ctx).repository()
    except StateError:
        return None  # the admin's machine need not hold the server's state DB
    deadline = time.monotonic() + wait
    while True:
        try:
            return repo.get_run(flower_run_id).id
        except NotFoundError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.25)


@runs_app.command("resume")
def resume(ctx: typer.Context, run: Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")],
           superlink: SuperlinkOpt = DEFAULT_SUPERLINK, insecure: InsecureOpt = False, ca_cert: CaCertOpt = None,
           follow: Annotated[bool, typer.Option(help="Show progress until the run ends.")] = False,
           timeout: Annotated[float, typer.Option(help="With --follow: give up after this many seconds.")] = 3600.0,
           ) -> None:
    """Continue an interrupted run from its last completed round (its unfinished round is redone)."""
    state = settings(ctx)
    from quorumfl.deploy.resume import resume_run, who_trains_again

    repo, control = state.repository(), state.control(superlink, insecure=insecure, ca_cert=ca_cert)
    again, missing = who_trains_again(repo, {n.node_id for n in control.nodes() if n.status == "online"}, run)
    if missing:
        err_console.print(f"[yellow]the next round trains again from the model of a failed attempt by {again}; "
                          f"{missing} not connected[/yellow]: the others would train it with another set, and those "
                          "that confirmed the attempt refuse (their contribution ledgers); start those nodes first, "
                          "then resume", highlight=False)
    elif again:
        console.print(f"the next round trains again from the model of a failed attempt: asked of the same departments "
                      f"({again}), as their contribution ledgers require", highlight=False)
    record = repo.get_run(run)
    flower_run_id = resume_run(repo, control, run)
    console.print(f"[green]run {record.id} resumed as Flower run {flower_run_id}[/green]; follow it with "
                  f"'quorumfl runs show {record.id}'", highlight=False)
    if follow:
        _follow(ctx, control, flower_run_id, record.id, record.num_rounds, timeout)


@runs_app.command("list")
def list_runs(ctx: typer.Context, fmt: FormatOpt = Format.TABLE) -> None:
    """All runs: status, privacy (masked, ckks or plaintext; +dp), rounds, the final model's metric, task."""
    rows = run_summaries(settings(ctx).reader())
    if fmt is Format.JSON:
        print_json(rows)
        return
    for row in rows:
        row["rounds"] = f"{row['rounds_completed']}/{row['rounds_planned']}"
        row["metric"] = row["round_metric"] if row["final_metric"] is not None else None
        row["final"] = row["final_metric"]
        row["started"] = short_time(row["started_at"])
        row["privacy"] = row["privacy_label"]
    console.print(table("Runs", rows, ["id", "status", "privacy", "rounds", "metric", "final", "strategy", "task",
                                       "started", "flower_run_id"],
                        optional=["metric", "strategy", "task", "started", "flower_run_id"]))


@runs_app.command("show")
def show(ctx: typer.Context, run: Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")], fmt: FormatOpt = Format.TABLE) -> None:
    """One run: config, rounds with the global model's metric, each department's metric of the final model."""
    from quorumfl.server.services import department_columns, run_view

    view = run_view(settings(ctx).repository(), run)
    if fmt is Format.JSON:
        print_json(view)
        return
    console.print(f"[bold]Run {view['id']}[/bold] (Flower {view['flower_run_id']}): {view['status']}, "
                  f"{view['strategy']}, {view['task']}", highlight=False)
    console.print(view["privacy"], highlight=False)
    if view["stopped_early_after"] is not None:
        console.print(f"stopped early after round {view['stopped_early_after']}: no better {view['round_metric']} in "
                      f"{view['config'].get('early-stop-patience')} rounds", highlight=False)
    if view["error"]:
        console.print(f"[red]{view['error']}[/red]")
    metric, primary = view["round_metric"], view["primary_metric"]
    loss = {primary: "loss", f"federated-{primary}": "federated-loss"}.get(metric)  # none beside train-loss
    rows = [
        {"round": r["round"], "status": r["status"], metric: r["metrics"].get(metric),
         **({loss: r["metrics"].get(loss)} if loss else {}), "nodes": len(r["participants"]),
         "failures": len(r["failures"]), "seconds": sum(v for k, v in r["timings_s"].items() if k != "local_train_max")}
        for r in view["rounds"]
    ]
    columns = ["round", "status", metric, *([loss] if loss else []), "nodes", "failures", "seconds"]
    console.print(table("Global model per round", rows, columns, optional=[*([loss] if loss else []), "seconds"]))
    if view["departments"]:
        console.print(table("Final models per department (own test split): the federation's model (global, or "
                            "its cluster's), the personal and tuned ones, and the one it trained alone", view["departments"],
                            department_columns(view["departments"], primary), optional=DEPARTMENT_OPTIONAL))
        if view["joining"]:
            console.print(view["joining"], highlight=False)


@runs_app.command("report")
def report(
    ctx: typer.Context,
    run: Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")],
    out: OutOpt = Path("."),
    fmt: ReportFormatOpt = ReportFormat.HTML,
    open_page: OpenOpt = False,
) -> None:
    """A run's report: metric and loss per round (and per cluster), each department's final model, time per
    round by stage, who took part in each round, bytes up and down, ε against each department's budget,
    model versions with rollbacks. Figures are embedded PNG: the page works offline."""
    from quorumfl.server.report import render_html, report_data

    data = report_data(settings(ctx).repository(), run)
    emit_report(data, fmt, out, f"run-{data['run']['id']}.html", lambda: render_html(data), open_page=open_page)


@runs_app.command("compare")
def compare(
    ctx: typer.Context,
    runs: Annotated[list[int], typer.Argument(help="Two or more run ids (QuorumFL or Flower).")],
    out: OutOpt = Path("."),
    fmt: ReportFormatOpt = ReportFormat.HTML,
    open_page: OpenOpt = False,
) -> None:
    """Overlay runs: metric and loss per round, their summaries, and the run-config keys that differ."""
    from quorumfl.server.report import compare_data, render_compare_html

    data = compare_data(settings(ctx).repository(), runs)
    name = "compare-" + "-".join(str(r["run"]["id"]) for r in data["runs"]) + ".html"
    emit_report(data, fmt, out, name, lambda: render_compare_html(data), open_page=open_page)


@runs_app.command("stop")
def stop(ctx: typer.Context, run: Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")],
         superlink: SuperlinkOpt = DEFAULT_SUPERLINK, insecure: InsecureOpt = False, ca_cert: CaCertOpt = None) -> None:
    """Stop a running run at the SuperLink and record it as stopped."""
    from quorumfl.server.state.repository import STOPPED_BY_ADMIN, RunStatus

    repo = settings(ctx).repository()
    record = repo.get_run(run)
    if record.status != RunStatus.RUNNING:  # nothing to stop: what the admin wanted already holds
        console.print(f"run {record.id} is not running (it is {record.status}); nothing to stop")
        return
    if record.flower_run_id is None:
        raise ConfigError(f"run {record.id} has no Flower run id to stop")
    failed_since = repo.unfinished_from(record.id)
    settings(ctx).control(superlink, insecure=insecure, ca_cert=ca_cert).stop_run(record.flower_run_id)
    # Stopped first: a ServerApp still between rounds then starts no new one (RunStoppedError), a round
    # it ends from now on as failed is recorded aborted, and the sweep after it catches a round it
    # started before or one the stop made fail before the run was recorded as stopped.
    repo.finish_run(record.id, RunStatus.STOPPED, error=STOPPED_BY_ADMIN)
    repo.abort_running_rounds(record.id, STOPPED_BY_ADMIN, failed_since=failed_since)
    console.print(f"run {record.id} stopped")


@rounds_app.command("list")
def list_rounds(ctx: typer.Context, run: Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")], fmt: FormatOpt = Format.TABLE) -> None:
    """Rounds of a run: status, participants, phase timings, node failures with reasons."""
    from quorumfl.server.services import round_flags, round_view

    repo = settings(ctx).repository()
    departments = {n.node_id: n.department for n in repo.list_nodes()}
    rounds = repo.list_rounds(run)
    flags = round_flags(repo, rounds[0].run_id, departments) if rounds else {}
    rows = [{**round_view(r, departments), "flagged": flags.get(r.number) if r.status == "completed" else None}
            for r in rounds]
    if fmt is Format.JSON:
        print_json(rows)
        return
    flat = []
    for r in rows:
        stages = {k: v for k, v in r["timings_s"].items() if k != "local_train_max"}
        slowest = max(stages, key=stages.__getitem__, default=None)
        flat.append({**r, "nodes": f"{len(r['participants'])}/{r['selected']}", "seconds": f"{sum(stages.values()):.1f}",
                     "slowest_stage": f"{slowest} {stages[slowest]:.1f}s" if slowest else None,
                     "failures": len(r["failures"]), "participants": ", ".join(r["participants"]),
                     "flagged": r["flagged"]["count"] if r["flagged"] else None})
    console.print(table(f"Rounds of run {run}", flat, ["round", "attempt", "status", "nodes", "seconds", "slowest_stage",
                                                       "failures", "flagged", "participants"],
                        optional=["attempt", "slowest_stage", "flagged", "participants"]))
    for r in rows:  # the reasons, one line each, after the table (every stage's time: --format json)
        for f in r["failures"]:
            console.print(f"round {r['round']}: {f['node']} ({f['stage']}): {f['reason']}", highlight=False)
        if r["error"]:
            console.print(f"round {r['round']}: {r['error']}", highlight=False)
        if r["flagged"] and r["flagged"]["count"]:
            who = ", ".join(r["flagged"]["departments"]) or "in the secure sum's histograms"
            console.print(f"round {r['round']}: {r['flagged']['count']} update(s) stood out ({who}); see 'runs report'",
                          highlight=False)
