"""``quorumfl runs …`` and ``quorumfl rounds …``."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from quorumfl.aggregation.errors import ConfigError

from ..config import RunConfig, load_run_config_file
from ..resume import resume_run
from ..services import follow_run, round_view, run_summary, run_view
from ..state.orm import Round, Run
from ..state.repository import Repository, RunStatus
from .context import DEFAULT_SUPERLINK, settings
from .output import Format, console, print_json, table

runs_app = typer.Typer(help="Start, follow, inspect and stop federated training runs.", no_args_is_help=True)
rounds_app = typer.Typer(help="Inspect the rounds of a run.", no_args_is_help=True)

FormatOpt = Annotated[Format, typer.Option("--format", help="Output format.")]
SuperlinkOpt = Annotated[str, typer.Option("--superlink", help="SuperLink address HOST:PORT (Control API).")]
InsecureOpt = Annotated[bool, typer.Option("--insecure", help="The SuperLink runs without TLS (warns).")]
CaCertOpt = Annotated[Path | None, typer.Option("--ca-cert", help="Federation CA certificate (default HOME/certs/ca.crt).")]


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key=value (e.g. -c num-rounds=10)")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word is a string
    return key.strip(), value


def round_progress(total: int) -> tuple[Progress, Any]:
    progress = Progress(
        TextColumn("[bold]rounds"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
    )
    task = progress.add_task("", total=total)
    return progress, task


def round_reporter(repo: Repository, progress: Progress, task: Any) -> Callable[[Run, Round], None]:
    """A ``follow_run`` callback that advances the progress bar with each finished round."""

    def on_round(run: Run, rnd: Round) -> None:
        accuracy = next(
            (m.value for m in repo.metrics(run.id, name="accuracy") if m.round == rnd.number and m.node_id is None),
            None,
        )
        acc = f"accuracy {accuracy:.3f}" if accuracy is not None else rnd.status
        failed = f", {len(rnd.failures)} node failure(s)" if rnd.failures else ""
        progress.update(task, advance=1, description=f"round {rnd.number}: {acc}, {len(rnd.participants)} nodes{failed}")

    return on_round


@runs_app.command("start")
def start(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="Run config TOML (keys of [tool.flwr.app.config], top level or [run]).")],
    override: Annotated[list[str] | None, typer.Option("-c", "--config-override", help="key=value, repeatable.")] = None,
    superlink: SuperlinkOpt = DEFAULT_SUPERLINK,
    follow: Annotated[bool, typer.Option(help="Show progress until the run ends.")] = False,
    timeout: Annotated[float, typer.Option(help="With --follow: give up after this many seconds.")] = 3600.0,
    insecure: InsecureOpt = False,
    ca_cert: CaCertOpt = None,
) -> None:
    """Submit a run of the QuorumFL app to the SuperLink (as `flwr run` does)."""
    values = load_run_config_file(config)
    values.update(dict(_parse_override(o) for o in override or []))
    resolved = RunConfig.from_mapping(values)
    control = settings(ctx).control(superlink, insecure=insecure, ca_cert=ca_cert)
    flower_run_id = control.start_run(values)
    console.print(f"[green]started run {flower_run_id}[/green] ({resolved.strategy}, {resolved.num_rounds} rounds)")
    if follow:
        repo = settings(ctx).repository()
        progress, task = round_progress(resolved.num_rounds)
        with progress:
            run = follow_run(
                repo, flower_run_id, timeout=timeout, on_round=round_reporter(repo, progress, task),
                alive=lambda: not control.run_finished(flower_run_id),
            )
        console.print(f"run {run.id}: {run.status}" + (f" ({run.error})" if run.error else ""))


@runs_app.command("resume")
def resume(ctx: typer.Context, run: Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")],
           superlink: SuperlinkOpt = DEFAULT_SUPERLINK, insecure: InsecureOpt = False, ca_cert: CaCertOpt = None) -> None:
    """Continue an interrupted run from its last completed round (its unfinished round is redone)."""
    state = settings(ctx)
    flower_run_id = resume_run(state.repository(), state.control(superlink, insecure=insecure, ca_cert=ca_cert), run)
    console.print(f"[green]run {run} resumed as Flower run {flower_run_id}[/green]; follow it with "
                  f"'quorumfl runs show {run}'")


@runs_app.command("list")
def list_runs(ctx: typer.Context, fmt: FormatOpt = Format.TABLE) -> None:
    """All runs with status and final global accuracy."""
    repo = settings(ctx).repository()
    rows = [run_summary(repo, r) for r in repo.list_runs()]
    if fmt is Format.JSON:
        print_json(rows)
        return
    console.print(table("Runs", rows, ["id", "flower_run_id", "status", "strategy", "dataset", "rounds_completed", "rounds_planned", "final_accuracy", "started_at"]))


@runs_app.command("show")
def show(ctx: typer.Context, run: Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")], fmt: FormatOpt = Format.TABLE) -> None:
    """One run: config, rounds with global accuracy, per-department accuracy of the final model."""
    view = run_view(settings(ctx).repository(), run)
    if fmt is Format.JSON:
        print_json(view)
        return
    console.print(f"[bold]Run {view['id']}[/bold] (Flower {view['flower_run_id']}): {view['status']}, "
                  f"{view['strategy']} on {view['dataset']} with {view['model']}")
    if view["error"]:
        console.print(f"[red]{view['error']}[/red]")
    rows = [
        {"round": r["round"], "status": r["status"], "accuracy": r["metrics"].get("accuracy"),
         "loss": r["metrics"].get("loss"), "nodes": len(r["participants"]), "failures": len(r["failures"]),
         "seconds": sum(v for k, v in r["timings_s"].items() if k != "local_train_max")}
        for r in view["rounds"]
    ]
    console.print(table("Global model per round", rows, ["round", "status", "accuracy", "loss", "nodes", "failures", "seconds"]))
    if view["departments"]:
        extra = [c for c in ("personal-accuracy", "cluster") if any(c in d for d in view["departments"])]
        console.print(table("Final models per department (own test split): the federation's model (global, or "
                            "its cluster's) and the personal one", view["departments"],
                            ["department", "accuracy", *extra, "loss", "num-examples"]))


@runs_app.command("stop")
def stop(ctx: typer.Context, run: Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")],
         superlink: SuperlinkOpt = DEFAULT_SUPERLINK, insecure: InsecureOpt = False, ca_cert: CaCertOpt = None) -> None:
    """Stop a running run at the SuperLink and record it as stopped."""
    repo = settings(ctx).repository()
    record = repo.get_run(run)
    if record.status != RunStatus.RUNNING:
        raise ConfigError(f"run {record.id} is already {record.status}; only running runs can be stopped")
    if record.flower_run_id is None:
        raise ConfigError(f"run {record.id} has no Flower run id to stop")
    settings(ctx).control(superlink, insecure=insecure, ca_cert=ca_cert).stop_run(record.flower_run_id)
    repo.abort_running_rounds(record.id, "run stopped by the admin")
    repo.finish_run(record.id, RunStatus.STOPPED, error="stopped by the admin")
    console.print(f"run {record.id} stopped")


@rounds_app.command("list")
def list_rounds(ctx: typer.Context, run: Annotated[int, typer.Argument(help="Run id (QuorumFL or Flower).")], fmt: FormatOpt = Format.TABLE) -> None:
    """Rounds of a run: status, participants, phase timings, node failures with reasons."""
    repo = settings(ctx).repository()
    departments = {n.node_id: n.department for n in repo.list_nodes()}
    rows = [round_view(r, departments) for r in repo.list_rounds(run)]
    if fmt is Format.JSON:
        print_json(rows)
        return
    flat = [
        {**r, "timings": ", ".join(f"{k} {v:.2f}s" for k, v in r["timings_s"].items()),
         "failures": "; ".join(f"{f['node']} ({f['stage']}): {f['reason']}" for f in r["failures"])}
        for r in rows
    ]
    console.print(table(f"Rounds of run {run}", flat, ["round", "status", "selected", "participants", "timings", "failures"]))
