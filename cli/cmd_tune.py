"""``quorumfl tune``: federated hyper-parameter search, each trial a federated run (``server.search``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from quorumfl.cli.cmd_runs import CaCertOpt, FormatOpt, InsecureOpt, SuperlinkOpt
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
    table,
)
from quorumfl.errors import ConfigError
from quorumfl.privacy.budget import DEFAULT_DP_BUDGET

__all__ = ["tune_app"]

tune_app = typer.Typer(no_args_is_help=True,
                       help="Federated hyper-parameter search: each trial a federated run (Optuna).")

@tune_app.command("run")
def run_command(
    ctx: typer.Context,
    config: Annotated[Path, typer.Argument(help="Search config TOML: [run] (the run config every trial shares) "
                                                "and [search] (run-config keys with ranges or choices).")],
    trials: Annotated[int, typer.Option(help="Trials to run now (a study continues where it stopped).")] = 12,
    study: Annotated[str | None, typer.Option(help="Name the trials are recorded under (default: the config "
                                                   "file's name).")] = None,
    sampler: Annotated[str, typer.Option(help="tpe (learns from the trials so far) or random.")] = "tpe",
    prune: Annotated[bool, typer.Option(help="Stop trials whose rounds trail the others' (successive halving).")] = True,
    min_rounds: Annotated[int, typer.Option(help="Rounds every trial runs before it can be stopped.")] = 2,
    rounds_budget: Annotated[int, typer.Option(help="Start no more trials once this search's trials have run this "
                                                    "many rounds in all (0: --trials alone decides).")] = 0,
    seed: Annotated[int, typer.Option(help="The sampler's seed.")] = 0,
    departments: Annotated[int, typer.Option(help="Virtual departments of the simulation.")] = 4,
    split: Annotated[str, typer.Option(help="How the built-in dataset is split: iid, dirichlet or shards.")] = "iid",
    alpha: Annotated[float, typer.Option(help="Dirichlet α of --split dirichlet.")] = 0.5,
    data: Annotated[Path | None, typer.Option(help="Partition folders to simulate instead, one per department.")] = None,
    cpus: Annotated[int, typer.Option(help="CPUs for the simulation's ClientApps (0: all).")] = 0,
    federation: Annotated[bool, typer.Option(help="Run the trials on the deployed federation (--superlink) "
                                                  "instead of the simulation engine.")] = False,
    superlink: SuperlinkOpt = DEFAULT_SUPERLINK,
    insecure: InsecureOpt = False,
    ca_cert: CaCertOpt = None,
    timeout: Annotated[float, typer.Option(help="With --federation: the most seconds one trial may take.")] = 3600.0,
    dp_budget: Annotated[float, typer.Option(help="Under DP: the ε per department the whole search may spend "
                                                  "(the virtual departments' budget too).")] = DEFAULT_DP_BUDGET,
    out: Annotated[Path | None, typer.Option(help="Where the best trial's run config is written (default: "
                                                  "best-STUDY.toml).")] = None,
) -> None:
    """Search run-config values with Optuna (TPE, pruning), each trial a federated run, and write the best
    run config. Trials are recorded in the state DB; under DP the search's ε must fit the budget first."""
    from quorumfl.server.config import RunConfig
    from quorumfl.server.search import SearchPlan, run_search
    from quorumfl.server.search_space import check_budget, load_search_file, privacy_plan

    base, space = load_search_file(config)
    state = settings(ctx)
    if federation:  # the server keeps its own state DB and models; it need not share our files
        from quorumfl.server.run_task import inline_schema

        schema = RunConfig.from_mapping(base).task_schema
        if schema and not schema.lstrip().startswith("{"):
            base["task-schema"] = inline_schema(Path(schema))
    else:
        base.setdefault("state-url", state.db_url)
        base.setdefault("model-dir", str(state.home / "models"))
    plan = SearchPlan(study=study or config.stem, base=base, space=space, trials=trials, sampler=sampler,
                      prune=prune, min_rounds=min_rounds, seed=seed, dp_budget=dp_budget, max_rounds=rounds_budget)
    check_budget(privacy_plan(RunConfig.from_mapping(base), trials), 0.0, dp_budget)  # before anything is made
    repo = state.repository(migrate=True)
    spent = 0.0  # on the federation only the nodes know theirs (their ledgers refuse past their own budget)
    if federation:
        from quorumfl.deploy.tuning import federation_runner

        runner = federation_runner(repo, state.control(superlink, insecure=insecure, ca_cert=ca_cert), timeout=timeout)
    else:
        from quorumfl.deploy.simulation import SimulationSettings
        from quorumfl.deploy.tuning import prepared_simulation

        folder = state.home / "tuning" / plan.study
        sim = SimulationSettings(departments=departments, root=folder, split=split, alpha=alpha, data=data, cpus=cpus)
        runner, spent = prepared_simulation(repo, sim, RunConfig.from_mapping(base), folder, budget=dp_budget)
    where = "the federation" if federation else f"{departments} virtual departments"
    err_console.print(f"[dim]search '{plan.study}': {trials} trial(s) over {', '.join(space.describe())} "
                      f"({sampler}{', pruned' if prune else ''}) on {where}[/dim]")
    trials_done = run_search(repo, plan, runner, spent=spent, on_trial=_say_trial)
    _write_best(plan.study, base, trials_done, out or Path(f"best-{plan.study}.toml"))


def _say_trial(trial: Any) -> None:
    figure = f"{trial.metric} {trial.value:.4g}" if trial.value is not None else "no final figure"
    values = ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in trial.params.items())
    err_console.print(f"trial {trial.number}: {trial.state}, {figure} (run {trial.run_id}); {values}", highlight=False)


def _write_best(study: str, base: dict[str, Any], trials: list[Any], target: Path) -> None:
    import tomli_w

    from quorumfl.server.search import best_trial

    best = best_trial(trials)
    if best is None:
        raise ConfigError(f"no trial of search '{study}' completed; 'quorumfl tune show {study}' shows why")
    chosen = {k: v for k, v in {**base, **best.params}.items() if k not in ("state-url", "model-dir")}
    target.write_text(tomli_w.dumps({"run": chosen}))
    console.print(f"[green]best: trial {best.number} (run {best.run_id}), {best.metric} {best.value:.4g}[/green]; its "
                  f"run config is in {target} ('quorumfl runs start {target}' runs it)", highlight=False)


@tune_app.command("list")
def list_command(ctx: typer.Context, fmt: FormatOpt = Format.TABLE) -> None:
    """Every search in the state DB, with its number of trials."""
    rows = [{"study": name, "trials": count} for name, count in settings(ctx).repository().studies()]
    if fmt is Format.JSON:
        print_json(rows)
        return
    console.print(table("Searches", rows, ["study", "trials"]))


@tune_app.command("show")
def show_command(ctx: typer.Context, study: Annotated[str, typer.Argument(help="The search's study name.")],
                 fmt: FormatOpt = Format.TABLE) -> None:
    """A search's trials: the values each tried, its run, state, rounds and final figure; the best."""
    from quorumfl.server.search_view import search_view

    view = search_view(settings(ctx).repository(), study)
    if fmt is Format.JSON:
        print_json(view)
        return
    keys = sorted(view["space"])
    rows = [{**r, **r["params"]} for r in view["trials"]]
    console.print(table(f"Search '{study}' ({view['metric']})", rows,
                        ["trial", "state", "run", *keys, "rounds", "value"]))
    best = view["best"]
    console.print(f"best: trial {best['trial']} (run {best['run']}), {view['metric']} {best['value']:.4g}"
                  if best else "no trial completed", highlight=False)


@tune_app.command("report")
def report_command(ctx: typer.Context, study: Annotated[str, typer.Argument(help="The search's study name.")],
                   fmt: ReportFormatOpt = ReportFormat.HTML, out: OutOpt = Path("reports"),
                   open_page: OpenOpt = False) -> None:
    """A search's page: what it varied, the best trial, the plot of the search and every trial."""
    from quorumfl.server.search_view import render_search, search_view

    view = search_view(settings(ctx).repository(), study)
    emit_report(view, fmt, out, f"search-{study}.html", lambda: render_search(view), open_page=open_page)
