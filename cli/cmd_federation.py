"""``quorumfl demo``, ``server start``, ``node start``, ``db upgrade``."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from quorumfl.cli.cmd_runs import print_finished_run, round_progress, round_reporter, stage_reporter
from quorumfl.cli.context import DEFAULT_SUPERLINK, INSECURE_WARNING, settings
from quorumfl.cli.output import console, err_console, print_json, table
from quorumfl.core.data import read_partition
from quorumfl.deploy.app_guard import app_guard_env
from quorumfl.deploy.certs import Credentials, check_node_key, check_server
from quorumfl.deploy.control import Control
from quorumfl.deploy.demo import DemoSettings, run_demo
from quorumfl.deploy.host_slots import host_slot_env
from quorumfl.deploy.processes import (
    REJOIN_GRACE_S,
    REJOIN_RETRY_S,
    Child,
    NodeCredentials,
    NodePresence,
    ProcessGroup,
    activated,
    activation_refused,
    check_port_free,
    flower_env,
    free_port,
    superlink_command,
    supernode_command,
    tls_failed,
    wait_for_port,
)
from quorumfl.deploy.registration import record_registrations, sync_registrations
from quorumfl.deploy.resume import resume_interrupted
from quorumfl.deploy.supernode import DEFAULT_POLL_S, POLL_ENV
from quorumfl.deploy.warm import warm_env
from quorumfl.errors import ConfigError, CredentialError, DataError, FederationError
from quorumfl.server.config import SecureMode
from quorumfl.server.services import budget_view
from quorumfl.server.state.database import connect

server_app = typer.Typer(help="The coordinating server (Flower SuperLink + QuorumFL state).", no_args_is_help=True)
node_app = typer.Typer(help="A department node (Flower SuperNode running the QuorumFL ClientApp).", no_args_is_help=True)
db_app = typer.Typer(help="The state database.", no_args_is_help=True)


def demo(
    ctx: typer.Context,
    departments: Annotated[int, typer.Option(help="Number of department nodes (SuperNodes).")] = 4,
    rounds: Annotated[int, typer.Option(help="Training rounds.")] = 5,
    alpha: Annotated[float, typer.Option(help="Dirichlet α of the label skew (smaller = more skewed).")] = 0.5,
    strategy: Annotated[str, typer.Option(help="fedavg, fedprox, ifca (clustered), fedper or ditto (personalised); "
                                               "default the run config's (fedavg with server momentum).")] = "",
    mu: Annotated[float | None, typer.Option(help="FedProx proximal coefficient μ (default the run config's).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for the split, the model and the sampling.")] = 0,
    secure_aggregation: Annotated[
        SecureMode, typer.Option(help="masking: the server sees only the sum of a quorum's updates; ckks: it adds "
                                    "ciphertexts that t departments jointly decrypt; none: plaintext.")
    ] = SecureMode.MASKING,
    learning_task: Annotated[str, typer.Option("--task", help="image (digits, embedded), tabular (Ames property sales by neighbourhood) or "
                                           "text (WordNet glosses); tabular and text need './setup.sh --city-data'.")
                    ] = "image",
) -> None:
    """Run a real local federation: SuperLink + one SuperNode per department on 127.0.0.1."""
    state = settings(ctx)
    progress, task = round_progress(rounds)
    started = time.monotonic()
    repo = state.repository(migrate=True)
    with progress:
        run = run_demo(
            DemoSettings(home=state.home, departments=departments, rounds=rounds, alpha=alpha, seed=seed,
                         strategy=strategy, proximal_mu=mu, secure_aggregation=secure_aggregation.value,
                         db_url=state.db_url, task=learning_task),
            repo,
            on_status=lambda msg: progress.console.print(f"[dim]{msg}[/dim]"),
            on_round=round_reporter(repo, progress, task),
            on_progress=stage_reporter(progress, task),
        )
    print_finished_run(repo, run, started)


CertsOpt = Annotated[Path | None, typer.Option("--certs", help="Credentials folder (default HOME/certs; "
                                                                "'quorumfl certs init' makes it).")]
InsecureOpt = Annotated[bool, typer.Option("--insecure", help="No TLS and no node authentication (warns); "
                                                              "for a trusted, isolated network only.")]


@server_app.command("start")
def server_start(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(help="Port of the SuperLink's HTTP APIs (Fleet, Control, Runtime).")] = int(DEFAULT_SUPERLINK.rsplit(":", 1)[1]),
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    certs: CertsOpt = None,
    insecure: InsecureOpt = False,
    resume: Annotated[bool, typer.Option(help="Resume the runs a crashed server left running (from their last "
                                              "completed round).")] = True,
    metrics_port: Annotated[int, typer.Option(help="Serve Prometheus metrics (rounds, stage times, nodes, bytes, "
                                                   "ε) from the state DB on this port (0 = off).")] = 0,
    metrics_host: Annotated[str, typer.Option(help="Address of the metrics endpoint (it has no credential "
                                                   "check: keep it on loopback or a monitoring network).")] = "127.0.0.1",
) -> None:
    """Run the Flower SuperLink with TLS and SuperNode authentication, and the QuorumFL state DB, until
    Ctrl-C. Registers the node keys of the credentials folder and unregisters retired ones; resumes
    the runs an interrupted server left behind; optionally serves Prometheus metrics."""
    state = settings(ctx)
    creds: Credentials | None = None
    if insecure:
        err_console.print(INSECURE_WARNING)
    else:
        creds = Credentials(certs.expanduser().resolve()) if certs else state.credentials
        check_server(creds)  # fail closed, before anything listens
        if not creds.admin_pub.exists():
            raise CredentialError(f"no admin public key at {creds.admin_pub}: the Control API would obey anyone who "
                                  "reaches the port; make it with 'quorumfl certs admin-key' on the admin's machine "
                                  "and copy admin.pub there")
    check_port_free(host, port)  # before "listening on" could describe another program's port
    if metrics_port:
        if not 0 < metrics_port < 65536 or metrics_port == port:
            raise ConfigError(f"--metrics-port {metrics_port} must be a free port other than --port {port} (1-65535)")
        check_port_free(metrics_host, metrics_port)
    connect(state.db_url, migrate=True)
    if metrics_port:
        from quorumfl.server.metrics_endpoint import serve_metrics

        serve_metrics(state.repository(), port=metrics_port, host=metrics_host)
        console.print(f"Prometheus metrics on http://{metrics_host}:{metrics_port}/metrics")
    cmd = superlink_command(port=port, host=host, database=state.home / "superlink.db", tls=creds)
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host

    def ready(child: Child) -> None:
        wait_for_port(local, port, timeout=60, process=child.process)
        mode = "TLS, node authentication" if creds else "INSECURE"
        console.print(f"[green]SuperLink listening on {host}:{port}[/green] ({mode}); state DB {state.db_url}; "
                      f"log {child.log}", soft_wrap=True)
        control = Control.for_federation(f"{local}:{port}", creds)
        if creds is not None and not creds.admin_key.exists():  # the server host holds admin.pub only, as it should
            console.print("the admin key is not on this host: register node keys with 'quorumfl certs register' "
                          "and resume interrupted runs with 'quorumfl runs resume' from the admin's machine")
            return
        if creds is not None:
            report = sync_registrations(control, creds)
            record_registrations(state.repository(), report)
            console.print(f"node keys: {len(report.kept) + len(report.registered)} registered"
                          + (f" ({', '.join(n for n, _ in report.registered)} new)" if report.registered else "")
                          + (f", {len(report.unregistered)} retired key(s) unregistered" if report.unregistered else ""))
        if resume:
            for run_id, flower_run_id in resume_interrupted(state.repository(), control):
                console.print(f"[yellow]run {run_id} was interrupted; resumed as Flower run {flower_run_id}[/yellow]")

    _run_in_foreground(flower_env(state.home, db_url=state.db_url), state.home / "logs", "superlink", cmd, ready)


CONNECT_WARNING_S = 30.0


@node_app.command("start")
def node_start(
    ctx: typer.Context,
    department: Annotated[str, typer.Option(help="Department name this node trains for.")],
    data: Annotated[Path, typer.Option(help="This department's partition directory.")],
    superlink: Annotated[str, typer.Option(help="SuperLink address HOST:PORT.")] = DEFAULT_SUPERLINK,
    port: Annotated[int, typer.Option(help="Local port of the SuperNode's own API (0 = a free one).")] = 0,
    dp_budget: Annotated[float | None, typer.Option(
        help="The department's total privacy budget ε over all runs (default 10); DP rounds past it are refused.")] = None,
    require_dp: Annotated[bool, typer.Option(help="Refuse every round that is not differentially private.")] = False,
    train_workers: Annotated[int, typer.Option(
        help="Training processes: gloo workers on CPU; on CUDA the GPUs to use (0 = every GPU, or 1 on CPU).")] = 0,
    checkpoint_every: Annotated[int, typer.Option(
        help="Checkpoint local training every N steps; a crashed round resumes from it (0 = off).")] = 0,
    ca_cert: Annotated[Path | None, typer.Option(help="Federation CA certificate (default HOME/certs/ca.crt).")] = None,
    admin_key: Annotated[Path | None, typer.Option(
        help="The admin's public key; the node runs only runs signed by it (default HOME/certs/admin.pub).")] = None,
    key: Annotated[Path | None, typer.Option(help="This node's private key (default HOME/certs/nodes/DEPARTMENT.key).")] = None,
    insecure: InsecureOpt = False,
    host_slots: Annotated[int, typer.Option(help="Nodes sharing this host train at most this many ClientApps at "
                                                 "once (give every such node the same value; 0 = no limit).")] = 0,
    rejoin_wait: Annotated[float | None, typer.Option(
        help="Seconds to keep trying, from its first refusal, while the SuperLink refuses this node's key. "
             "Default: what is left of "
             f"{REJOIN_GRACE_S:.0f} s after this key's node was last connected from this machine (after a crash the "
             "SuperLink still counts it online for a while), else 0: refused at once.",
        show_default=False)] = None,
    warn_after: Annotated[float, typer.Option(
        help="Say so when the SuperLink has not answered after this many seconds (the node keeps trying).")
    ] = CONNECT_WARNING_S,
    warm: Annotated[bool, typer.Option(
        "--warm-clientapps/--cold-clientapps",
        help="Fork each ClientApp from one process that has torch, Flower and QuorumFL imported (warm), or "
             "start a fresh interpreter per message, as Flower does (cold).")] = True,
    poll: Annotated[float, typer.Option(
        "--poll", help="Seconds between the SuperNode's requests for new messages while idle (Flower's own: 3).",
        min=0.05, max=3.0)] = DEFAULT_POLL_S,
) -> None:
    """Run a Flower SuperNode that serves the QuorumFL ClientApp on DATA, until Ctrl-C."""
    state = settings(ctx)
    extra: dict[str, bool | int | float | str] = {"train-workers": train_workers, "checkpoint-every": checkpoint_every,
                                                  "require-dp": require_dp}
    if dp_budget is not None:
        if not dp_budget > 0:
            raise typer.BadParameter(f"--dp-budget must be > 0, got {dp_budget}")
        extra["dp-budget"] = dp_budget
    tls: NodeCredentials | None = None
    if insecure:
        err_console.print(INSECURE_WARNING)
    else:
        tls = NodeCredentials((ca_cert or state.credentials.ca_cert).expanduser().resolve(),
                              (key or state.credentials.node_key(department)).expanduser().resolve())
        check_node_key(tls.key, tls.ca_cert)  # fail closed, before connecting
    part = read_partition(data)  # fail here, clearly, rather than in every round
    if part.department and part.department != department:
        raise DataError(f"--data {data} holds the partition of department {part.department!r} (its partition.json "
                        f"says so), not {department!r}'s; give this node its own department's partition")
    console.print(f"{department}: {len(part.train)} training and {len(part.test)} test examples of {part.dataset}")
    cmd = supernode_command(superlink=superlink, port=port or free_port(), data_path=data.resolve(), department=department,
                            node_config=extra, tls=tls)
    env = flower_env(state.home)
    if host_slots < 0:
        raise typer.BadParameter(f"--host-slots must be >= 0, got {host_slots}")
    if rejoin_wait is not None and not rejoin_wait >= 0:
        raise typer.BadParameter(f"--rejoin-wait must be >= 0 seconds, got {rejoin_wait}")
    if host_slots:
        env.update(host_slot_env(host_slots, state.home / "clientapp-slots", path=env["PATH"]))
    if tls is not None:  # only runs the admin signed (fails closed without the admin's public key)
        env.update(app_guard_env((admin_key or state.credentials.admin_pub).expanduser(),
                                 state.home / "clientapp-guard", path=env["PATH"]))
    if warm:
        env.update(warm_env(state.home / "clientapp-warm", path=env["PATH"], env=env))
    env[POLL_ENV] = str(poll)
    mode = "TLS, authenticated" if tls else "INSECURE"
    presence = NodePresence(state.home / "run", tls.key.read_bytes() if tls else f"insecure:{department}".encode())
    presence.acquire(f"a node with --department {department}")
    try:
        _run_in_foreground(
            env, state.home / "logs", f"node-{department}", cmd,
            lambda child: console.print(f"node {department}: connecting to the SuperLink at {superlink} ({mode}); "
                                        f"log {child.log}", soft_wrap=True),
            rejoin_wait=presence.rejoin_wait() if rejoin_wait is None else rejoin_wait,
            connected=lambda child: console.print(f"[green]node {department} connected[/green] to {superlink} ({mode})"),
            presence=presence,
            silent_after=warn_after,
            silence=f"no answer from the SuperLink at {superlink} yet: check --superlink (host and port) and that "
                    "'quorumfl server start' runs there; still trying (Ctrl-C stops)",
            tls_failure="" if tls is None else (
                f"the SuperLink at {superlink} did not verify against {tls.ca_cert}: that certificate is another "
                "federation's CA, or the server's certificate does not name this host; get the federation's ca.crt "
                "from the admin (or pass --ca-cert)"),
        )
    finally:
        presence.release()


@node_app.command("budget")
def node_budget(
    data: Annotated[Path, typer.Option(help="The department's partition directory (its privacy ledger lives there).")],
    delta: Annotated[float, typer.Option(help="δ at which ε is reported.")] = 1e-5,
    budget: Annotated[float | None, typer.Option(help="Also show what is left of this budget ε.")] = None,
    output: Annotated[str, typer.Option("--format", help="table or json.")] = "table",
) -> None:
    """The ε this department has spent, per run and in total (PRV accountant), and the rounds it refused."""
    from quorumfl.privacy.ledger import Ledger

    if output not in ("table", "json"):
        raise typer.BadParameter(f"--format must be table or json, got {output!r}")
    view = budget_view(Ledger.open(data), delta=delta, budget=budget)
    if output == "json":
        print_json(view)
        return
    console.print(table(f"privacy spent by {data.name} (δ = {delta:g})", view["runs"], ["run", "rounds", "epsilon"]))
    left = f", {view['left']:.3f} left of {budget:g}" if budget is not None else ""
    console.print(f"total ε = {view['total']:.3f}{left}")
    if view["refusals"]:
        console.print(table("refused rounds", view["refusals"], ["run", "round", "epsilon_would_be", "budget"]))


def _wait_reporting(child: Child, connected: Callable[[Child], None] | None, silent_after: float, silence: str,
                    presence: NodePresence | None = None) -> int:
    """Wait for ``child`` to exit; meanwhile say once when it connected (``connected``), or that it has
    not after ``silent_after`` seconds (``silence``)."""
    # Polled, not one blocking wait: a Ctrl-C that the kernel hands to another thread of this process
    # (Flower's and gRPC's) runs Python's handler only when the main thread next runs Python code.
    started, said, warned = time.monotonic(), False, False
    while (code := child.process.poll()) is None:
        if connected is not None:
            if said:
                if presence is not None:
                    presence.connected()
            elif activated(child):
                connected(child)
                said = True
            elif not warned and time.monotonic() - started > silent_after:
                err_console.print(f"[yellow]{silence}[/yellow]")
                warned = True
        time.sleep(0.25)
    return code


def _run_in_foreground(
    env: dict[str, str], log_dir: Path, name: str, cmd: list[str], on_started: Callable[[Child], None],
    *, rejoin_wait: float = 0.0, connected: Callable[[Child], None] | None = None, silent_after: float = 0.0,
    silence: str = "", tls_failure: str = "", presence: NodePresence | None = None,
) -> None:
    """Run one Flower process until it exits or we are interrupted; it (and its children) always stop.

    A SuperNode that the SuperLink refuses is started again for up to ``rejoin_wait`` seconds after
    the first refusal (counted from then, not from the start: a SuperNode that took longer than the
    wait to start and be refused is still tried again): after a crash, the SuperLink counts the
    node's previous SuperNode as online until its heartbeats lapse, and refuses the same key until
    then. ``connected`` is called once the SuperNode got its node id (``silence`` is said if it has
    not after ``silent_after`` seconds)."""
    deadline: float | None = None
    with ProcessGroup(log_dir, env) as group:
        child = group.start(name, cmd)
        on_started(child)
        while (code := _wait_reporting(child, connected, silent_after, silence, presence)) != 0 and activation_refused(child):
            if deadline is None:
                deadline = time.monotonic() + rejoin_wait
            if time.monotonic() >= deadline:
                break
            console.print(f"[yellow]the SuperLink refused {name} for now[/yellow]: a SuperNode with this key may "
                          f"still count as online there (one that crashed less than "
                          f"{REJOIN_GRACE_S - 30:.0f} s ago); trying again in {REJOIN_RETRY_S:.0f} s")
            time.sleep(REJOIN_RETRY_S)
            child = group.start(name, cmd)
    if code == 0 and connected is not None and activated(child):
        # Nothing here stopped it (Ctrl-C raises instead): Flower's SuperNode ends by itself, with
        # status 0, when the SuperLink no longer knows its node, which is what revoking its key does.
        raise CredentialError(
            f"{name} left the federation: the SuperLink dropped its key (the admin revoked or unregistered it with "
            f"'quorumfl certs revoke'); ask the admin whether this department still takes part. See {child.log}")
    if code != 0:
        if activation_refused(child):  # Flower (exit 305), still refused after the grace period
            tried = f" (kept trying for {rejoin_wait:.0f} s)" if rejoin_wait > 0 else ""
            raise CredentialError(
                f"the SuperLink refused {name}'s key{tried}: the key is not registered there (another federation's, "
                f"or never registered), it was revoked, or a SuperNode with this key runs on another machine; the "
                f"admin checks with 'quorumfl certs list' and registers a key with 'quorumfl certs register'. "
                f"See {child.log}")
        if tls_failed(child) and tls_failure:
            raise CredentialError(f"{tls_failure}; see {child.log}")
        raise FederationError(f"{name} exited with code {code}; see {child.log}")


@db_app.command("upgrade")
def db_upgrade(ctx: typer.Context) -> None:
    """Create or migrate the state database to the newest schema."""
    state = settings(ctx)
    connect(state.db_url, migrate=True)
    console.print(f"state database at {state.db_url} is up to date")
