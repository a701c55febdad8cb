"""``quorumfl simulate``: a run config on N virtual departments (Flower's simulation engine)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from quorumfl.cli.cmd_runs import parse_override, print_finished_run
from quorumfl.cli.context import settings
from quorumfl.cli.output import err_console
from quorumfl.deploy.simulation import SimulationSettings, simulate

__all__ = ["simulate_command"]

SHOWN_DEPARTMENTS = 20  # a larger simulation's per-department table is left to 'runs show'


def simulate_command(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Argument(
        help="Run config TOML (keys of [tool.flwr.app.config], top level or [run]); none: the defaults and -c.")] = None,
    override: Annotated[list[str] | None, typer.Option("-c", "--config-override", help="key=value, repeatable.")] = None,
    departments: Annotated[int, typer.Option(help="Number of virtual departments.")] = 10,
    split: Annotated[str, typer.Option(help="How the run's built-in dataset is split: iid, dirichlet or shards.")] = "iid",
    alpha: Annotated[float, typer.Option(help="Dirichlet α of --split dirichlet (smaller = more skewed).")] = 0.5,
    data: Annotated[Path | None, typer.Option(help="Partition folders to use instead, one per department "
                                                    "('data split' / 'data import' make them); any task.")] = None,
    cpus: Annotated[int, typer.Option(help="CPUs for the virtual departments' ClientApps, one each at a time "
                                           "(0: all).")] = 0,
    reproducible: Annotated[bool, typer.Option(help="Virtual departments train with the run's seed, as nodes "
                                                    "with node config reproducible-training do.")] = False,
    dropout: Annotated[float, typer.Option(help="Each virtual department fails each message (key set-up, "
                                                "training, unmasking, evaluation) with this probability.")] = 0.0,
    speeds: Annotated[str, typer.Option(help="How fast each virtual department is, as a factor of this machine's "
                                             "speed (its replies wait accordingly, so deadlines and selectors see "
                                             "stragglers): lognormal:SIGMA (median 1, capped at 1) or a JSON file "
                                             "{\"DEPARTMENT\": SPEED}. Slow departments hold their ClientApp slot "
                                             "while they wait: give --cpus more slots than cores.")] = "",
    availability: Annotated[float, typer.Option(help="Seconds: each virtual department is offline for a quarter "
                                                      "of every such period of the simulation's clock, at a phase "
                                                      "of its own (its messages then fail, as dropouts); 0: always "
                                                      "online.")] = 0.0,
    keep: Annotated[Path | None, typer.Option(help="Keep the simulation folder (partitions, node state) here; "
                                                    "by default it is removed when the run ends.")] = None,
    verbose: Annotated[bool, typer.Option(help="Show Flower's and Ray's logs and the ClientApps' output.")] = False,
) -> None:
    """Run a config on N virtual departments with Flower's simulation engine (the same ServerApp and
    ClientApp, recorded in the same state DB: 'runs show', 'rounds list' and 'runs report' read it)."""
    from quorumfl.server.config import load_run_config_file

    state = settings(ctx)
    values = load_run_config_file(config) if config is not None else {}
    values.update(dict(parse_override(o) for o in override or []))
    values.setdefault("state-url", state.db_url)
    values.setdefault("model-dir", str(state.home / "models"))
    repo = state.repository(migrate=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="simulation-", dir=_scratch(state.home), ignore_cleanup_errors=True) as scratch:
        run_settings = SimulationSettings(
            departments=departments, root=keep if keep is not None else Path(scratch), split=split, alpha=alpha,
            data=data, cpus=cpus, node_config={"reproducible-training": True} if reproducible else {},
            dropout=dropout, speeds=speeds, availability=availability, keep=keep is not None, verbose=verbose)
        err_console.print(f"[dim]starting Flower's simulation engine: {departments} virtual departments on "
                          f"{cpus or 'all'} CPU(s)[/dim]")
        run = simulate(values, run_settings, repo)
    print_finished_run(repo, run, began, label=" (simulated)", department_limit=SHOWN_DEPARTMENTS)


def _scratch(home: Path) -> Path:
    folder = home / "simulations"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
