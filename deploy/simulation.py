"""Rehearse a federation on Flower's simulation engine: the same ServerApp and ClientApp, N virtual
departments, recorded in the same state DB as a deployed run.

``simulate`` splits the run's dataset across N virtual departments (or takes partition folders an
admin made with ``quorumfl data split`` / ``data import``), writes the simulation folder the
ClientApp's ``virtual_department`` mod reads (``client/virtual.py``), and runs Flower's simulation
runtime in this process: the ServerApp in a thread, the ClientApps in Ray actors (one CPU each, as
many actors as CPUs given), messages through Flower's in-memory link state. Everything QuorumFL does
in a round (selection, validation, masking or CKKS, DP, the state DB and model store) is the
deployed code; only the transport and the processes differ.

Flower's ``run_simulation`` is the in-process entry point of that runtime. Flower marks it deprecated
in favour of ``flwr run`` against its managed simulation SuperLink, which would build, ship and
install the app as a FAB and keep the run config and state DB out of the admin's hands; the
in-process call runs the installed package with the run config given here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from quorumfl.client.virtual import (
    AVAILABILITY_KEY,
    DROPOUT_KEY,
    SEED_KEY,
    SIMULATION_ROOT_ENV,
    START_KEY,
    NodeValue,
    write_layout,
)
from quorumfl.core.data import prepare_partitions
from quorumfl.deploy.sim_dispatch import one_pass_dispatch
from quorumfl.errors import ConfigError, FederationError, QuorumError
from quorumfl.server.config import RunConfig, expand_auto_rounds
from quorumfl.server.state.orm import Run
from quorumfl.server.state.repository import Repository

__all__ = ["RunHooks", "SimulationSettings", "department_speeds", "partitions_of", "simulate", "virtual_departments"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SimulationSettings:
    """What ``quorumfl simulate`` was asked: N virtual departments and how their data is made."""

    departments: int
    root: Path  # the simulation folder (partitions, node state); removed afterwards unless ``keep``
    split: str = "iid"  # the built-in dataset's partitioner: iid, dirichlet or shards
    alpha: float = 0.5
    data: Path | None = None  # partition folders to use instead (one per department)
    cpus: int = 0  # Ray's CPUs, one ClientApp actor each (0: all of this machine's)
    node_config: Mapping[str, NodeValue] = field(default_factory=dict)
    dropout: float = 0.0  # each virtual department fails each message with this probability
    speeds: str = ""  # how fast each virtual department is (``department_speeds``); "": all at this machine's speed
    availability: float = 0.0  # seconds: each department offline a quarter of every such period (0: always online)
    keep: bool = False
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.departments < 1:
            raise ConfigError(f"--departments must be at least 1, got {self.departments}")
        if self.cpus < 0:
            raise ConfigError(f"--cpus must be 0 (all) or more, got {self.cpus}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--dropout must be a probability in [0, 1), got {self.dropout}")
        if not 0.0 <= self.availability < math.inf:
            raise ConfigError(f"--availability must be a period in seconds (0: always online), got {self.availability}")


@dataclass(frozen=True)
class RunHooks:
    """What an in-process caller hears of the simulated run (``quorumfl tune`` follows and prunes its
    trials with them): its Flower run id as it starts, and each round as it ends, in the round loop."""

    on_start: Callable[[int], None] | None = None
    on_round: Callable[[int, int, dict[str, float]], None] | None = None


MAX_SIGMA = 4.0  # a log-normal σ past this puts most departments below a millionth of this machine's speed


def department_speeds(spec: str, names: Sequence[str], *, seed: int) -> list[float] | None:
    """Each department's speed factor S in (0, 1] (``client.virtual``: it takes 1/S times as long as
    this machine's ClientApp) from ``--speeds``; None for "" (all at this machine's speed).

    ``lognormal:SIGMA``: S drawn log-normal with median 1 and σ = SIGMA, as ``benchmarks/selection.py``
    draws departments' speeds, capped at 1 (a simulation cannot run faster than this machine, so
    half the departments run at its speed and the rest are slower); the draw follows the run's seed.
    Anything else is a JSON file ``{"DEPARTMENT": S, ...}``; a department it leaves out runs at 1."""
    if not spec:
        return None
    if spec.startswith("lognormal:"):
        raw = spec.split(":", 1)[1]
        try:
            sigma = float(raw)
        except ValueError:
            sigma = math.nan
        if not 0.0 < sigma <= MAX_SIGMA:
            raise ConfigError(f"--speeds {spec}: σ must be a number in (0, {MAX_SIGMA:g}], e.g. lognormal:1")
        draws = np.random.default_rng([seed, 0x5BEED]).lognormal(0.0, sigma, len(names))
        return [float(min(1.0, d)) for d in draws]
    path = Path(spec)
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--speeds {spec}: not 'lognormal:SIGMA' and not a readable JSON file ({exc}); give "
                          "'lognormal:1' or a file {\"DEPARTMENT\": SPEED, ...}") from None
    if not isinstance(body, dict):
        raise ConfigError(f"--speeds {spec}: the file must hold one JSON object {{\"DEPARTMENT\": SPEED, ...}}")
    unknown = sorted(set(body) - set(names))
    if unknown:
        raise ConfigError(f"--speeds {spec}: no department named {unknown[0]!r} in this simulation (its departments "
                          f"are {names[0]!r}…); name departments as 'runs show' lists them")
    speeds = []
    for name in names:
        value = body.get(name, 1.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value <= 1.0:
            raise ConfigError(f"--speeds {spec}: {name!r} has speed {value!r}; a speed is a factor in (0, 1] of this "
                              "machine's (0.25: four times as slow)")
        speeds.append(float(value))
    return speeds


def virtual_departments(count: int) -> list[str]:
    """The names of ``count`` virtual departments: dept-0000, dept-0001, …"""
    width = max(4, len(str(count - 1)))
    return [f"dept-{i:0{width}d}" for i in range(count)]


def partitions_of(settings: SimulationSettings, config: RunConfig) -> list[tuple[str, Path]]:
    """Each virtual department's partition folder: from ``--data``, else the built-in dataset split
    into ``settings.root / "parts"``."""
    if settings.data is not None:
        if not settings.data.is_dir():
            raise ConfigError(f"--data {settings.data} is not a folder; give the folder holding one partition "
                              "folder per department")
        folders = sorted(p for p in settings.data.iterdir() if p.is_dir())
        if len(folders) < settings.departments:
            raise ConfigError(f"--data {settings.data} holds {len(folders)} partition folder(s), --departments asks "
                              f"for {settings.departments}; split the data into that many ('quorumfl data split') "
                              "or ask for fewer")
        return [(p.name, p.resolve()) for p in folders[: settings.departments]]
    if config.task != "image":
        raise ConfigError(f"task '{config.task}': pass --data DIR with one partition folder per department "
                          "('quorumfl data import' or 'data split' make them); only the built-in image datasets "
                          "are split here")
    names = virtual_departments(settings.departments)
    parts = prepare_partitions(settings.root / "parts", names, dataset=config.dataset, method=settings.split,
                               alpha=settings.alpha, seed=config.seed, data_dir=config.data_path())
    return [(name, parts[name]) for name in names]


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables (inherited by Ray's workers) for the duration."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _server_app(values: Mapping[str, Any], seen: list[int], hooks: RunHooks) -> Any:
    """QuorumFL's ServerApp with this run config (``run_simulation`` hands the app an empty one) and
    the caller's hooks."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from quorumfl.server.app import serve

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        context.run_config = {**context.run_config, **values}
        seen.append(int(context.run_id))
        if hooks.on_start is not None:
            hooks.on_start(int(context.run_id))
        serve(grid, context, on_round=hooks.on_round)

    return app


def simulate(values: Mapping[str, Any], settings: SimulationSettings, repo: Repository, *,
             hooks: RunHooks | None = None) -> Run:
    """Run the run config ``values`` on ``settings.departments`` virtual departments; the recorded run."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("'quorumfl simulate' needs Flower's simulation engine (Ray), which is not installed: "
                          "run './setup.sh --simulation' (or pip install 'quorumfl[simulation]')")
    values = expand_auto_rounds(values)
    config = RunConfig.from_mapping(values)
    if settings.root.exists() and any(settings.root.iterdir()):
        raise ConfigError(f"simulation folder {settings.root} is not empty; give another one")
    try:
        partitions = partitions_of(settings, config)
        extra = {**settings.node_config, DROPOUT_KEY: settings.dropout, SEED_KEY: config.seed,
                 AVAILABILITY_KEY: settings.availability, START_KEY: time.time()}
        speeds = department_speeds(settings.speeds, [name for name, _ in partitions], seed=config.seed)
        write_layout(settings.root, partitions, extra, speeds)
        return _run(values, settings, repo, hooks or RunHooks())
    finally:
        if not settings.keep:
            shutil.rmtree(settings.root, ignore_errors=True)


def _run(values: Mapping[str, Any], settings: SimulationSettings, repo: Repository, hooks: RunHooks) -> Run:
    from flwr.server.superlink.fleet.vce.backend.backend import BackendConfig
    from flwr.simulation import run_simulation

    from quorumfl.client.app import app as client_app

    cpus = settings.cpus or os.cpu_count() or 1
    # Ray keeps its session (logs, sockets) under a temporary root, /tmp/ray unless told: each run gets
    # its own, removed afterwards. Short, as Ray puts Unix sockets (at most 107 bytes) under it.
    ray_root = tempfile.mkdtemp(prefix="quorumfl-ray-", dir=os.environ.get("RAY_TMPDIR") or "/tmp")
    backend: BackendConfig = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": cpus, "include_dashboard": False, "log_to_driver": settings.verbose,
                             "_temp_dir": ray_root}}
    seen: list[int] = []
    flower_log = logging.getLogger("flwr")
    level = flower_log.level
    if not settings.verbose:
        # Flower's deprecation banner, per-message debug lines and each failed message's traceback
        # (the state DB records every failure with its reason)
        flower_log.setLevel(logging.CRITICAL)
    env = {SIMULATION_ROOT_ENV: str(settings.root.resolve()), "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
           "RAY_DEDUP_LOGS": "0"}
    started = time.monotonic()
    try:
        with _environment(env), one_pass_dispatch():
            run_simulation(server_app=_server_app(values, seen, hooks), client_app=client_app,
                           num_supernodes=settings.departments, backend_config=backend)
    except QuorumError:
        raise
    except Exception as exc:  # Ray or Flower gave up: one line, the cause kept for --debug
        raise FederationError(f"the simulation stopped: {exc}") from exc
    finally:
        flower_log.setLevel(level)
        shutil.rmtree(ray_root, ignore_errors=True)
    if not seen:
        raise FederationError("the simulation ended before its ServerApp started; rerun with --verbose to see why")
    run = repo.get_run(seen[0])
    log.info("simulated run %s on %s virtual departments in %.1f s", run.id, settings.departments,
             time.monotonic() - started)
    return run
