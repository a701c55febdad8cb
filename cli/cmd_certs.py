"""``quorumfl certs …``: the federation's CA, the SuperLink certificate and the node keys."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from quorumfl.cli.context import DEFAULT_SUPERLINK, settings
from quorumfl.cli.output import console, table
from quorumfl.deploy.certs import (
    Credentials,
    add_admin_key,
    add_node_key,
    check_server,
    init_credentials,
    issue_server_cert,
    node_public_key,
    retire_node_key,
    server_hosts,
)
from quorumfl.deploy.control import sign_app_dir, store_flwr_token
from quorumfl.deploy.registration import (
    RegistrationReport,
    record_registrations,
    sync_registrations,
)
from quorumfl.errors import StateError

certs_app = typer.Typer(help="TLS certificates and SuperNode keys of the federation.", no_args_is_help=True)

DirOpt = Annotated[Path | None, typer.Option("--dir", help="Credentials folder (default HOME/certs).")]
HostOpt = Annotated[list[str] | None, typer.Option(
    "--host", help="Address or DNS name nodes use to reach the SuperLink; repeatable (default 127.0.0.1, localhost).")]
DaysOpt = Annotated[int, typer.Option(help="Days the SuperLink certificate stays valid.")]
SuperlinkOpt = Annotated[str | None, typer.Option(
    "--superlink", help="Also apply the change at this running SuperLink now (HOST:PORT); else at its next start.")]


def _creds(ctx: typer.Context, directory: Path | None) -> Credentials:
    return Credentials(directory.expanduser().resolve()) if directory else settings(ctx).credentials


def _report(report: RegistrationReport) -> None:
    for name, node in report.registered:
        console.print(f"registered node key {name} (SuperNode {node})")
    for name, node in report.unregistered:
        console.print(f"unregistered retired key {name} (SuperNode {node}): it is refused from now on")


def _apply(ctx: typer.Context, creds: Credentials, superlink: str | None) -> None:
    if superlink:
        report = sync_registrations(settings(ctx).control(superlink, ca_cert=creds.ca_cert, admin_key=creds.admin_key), creds)
        _report(report)
        _record_in_state(ctx, report)


def _record_in_state(ctx: typer.Context, report: RegistrationReport) -> None:
    """Where this machine holds the state DB (the server's), registered keys are listed in it."""
    try:
        record_registrations(settings(ctx).repository(), report)
    except StateError:  # no state DB here (the admin's own machine)
        return


@certs_app.command("init")
def init(
    ctx: typer.Context,
    nodes: Annotated[str, typer.Option(help="Comma-separated department node names, one key pair each.")] = "",
    host: HostOpt = None,
    days: DaysOpt = 365,
    directory: DirOpt = None,
) -> None:
    """Create the federation CA, the SuperLink's certificate and one key pair per node."""
    creds = _creds(ctx, directory)
    names = [n.strip() for n in nodes.split(",") if n.strip()]
    init_credentials(creds.root, hosts=host or ["127.0.0.1", "localhost"], nodes=names, days=days)
    console.print(f"[green]credentials created in {creds.root}[/green]")
    console.print(f"  SuperLink: {creds.server_cert}, {creds.server_key} (CA {creds.ca_cert})", soft_wrap=True)
    console.print(f"  admin: {creds.admin_key} signs Control API calls and runs; give {creds.admin_pub} to the "
                  "SuperLink and every node", soft_wrap=True)
    for name in names:
        console.print(f"  node {name}: give it {creds.ca_cert}, {creds.admin_pub} and {creds.node_key(name)}",
                      soft_wrap=True)
    console.print("'quorumfl server start' registers the node keys; keep ca.key, admin.key and the node keys secret.")


@certs_app.command("admin-key")
def admin_key(
    ctx: typer.Context,
    replace: Annotated[bool, typer.Option(help="Rotate: retire the current admin key and make a new one.")] = False,
    directory: DirOpt = None,
) -> None:
    """Make (or with --replace rotate) the admin's key, which signs Control API calls and runs.

    The SuperLink's Control API obeys only calls it signs and nodes run only runs it signs. After
    --replace, give the new admin.pub to the SuperLink (restart it) and to every node."""
    creds = _creds(ctx, directory)
    add_admin_key(creds, replace=replace)
    console.print(f"admin key {creds.admin_key}; give {creds.admin_pub} to the SuperLink and every node", soft_wrap=True)


@certs_app.command("add-node")
def add_node(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Department node name.")],
    replace: Annotated[bool, typer.Option(help="Rotate: retire the node's current key and make a new one.")] = False,
    superlink: SuperlinkOpt = None,
    directory: DirOpt = None,
) -> None:
    """A key pair for a new node (or, with --replace, a new key for an existing one)."""
    creds = _creds(ctx, directory)
    key = add_node_key(creds, name, replace=replace)
    console.print(f"node {name}: new key {key}; give it to the node with {creds.ca_cert}", soft_wrap=True)
    _apply(ctx, creds, superlink)


@certs_app.command("revoke")
def revoke(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Department node name.")],
    superlink: SuperlinkOpt = None,
    directory: DirOpt = None,
) -> None:
    """Retire a node's key: the SuperLink unregisters it and refuses that node from then on."""
    creds = _creds(ctx, directory)
    retired = retire_node_key(creds, name)
    console.print(f"node {name}: key retired to {retired}", soft_wrap=True)
    _disable_in_state(ctx, name)
    _apply(ctx, creds, superlink)


def _disable_in_state(ctx: typer.Context, department: str) -> None:
    """Where this machine holds the state DB (the server's): the department's nodes are disabled, so
    'nodes list' does not show a revoked node as selectable."""
    try:
        nodes = settings(ctx).repository().set_enabled(department, False)
    except StateError:  # no state DB here (the admin's own machine), or no node of it recorded yet
        return
    for node in nodes:
        console.print(f"node {node.node_id} ({department}) disabled in the state DB")


@certs_app.command("rotate-server")
def rotate_server(ctx: typer.Context, host: HostOpt = None, days: DaysOpt = 365, directory: DirOpt = None) -> None:
    """Issue a new SuperLink key and certificate from the same CA (restart the server to use it)."""
    creds = _creds(ctx, directory)
    hosts = host
    if not hosts:
        hosts = server_hosts(check_server(creds)) if creds.server_cert.exists() else ["127.0.0.1", "localhost"]
    issue_server_cert(creds, hosts=hosts, days=days)
    console.print(f"new SuperLink certificate {creds.server_cert} for {', '.join(hosts)}; restart 'quorumfl server start'")


@certs_app.command("register")
def register(ctx: typer.Context, superlink: Annotated[str, typer.Option(help="SuperLink HOST:PORT.")] = DEFAULT_SUPERLINK,
             directory: DirOpt = None) -> None:
    """Register new node keys and unregister retired ones at a running SuperLink."""
    creds = _creds(ctx, directory)
    report = sync_registrations(settings(ctx).control(superlink, ca_cert=creds.ca_cert, admin_key=creds.admin_key), creds)
    _report(report)
    _record_in_state(ctx, report)
    console.print(f"{len(report.kept)} node key(s) were already registered")


@certs_app.command("list")
def list_credentials(ctx: typer.Context, directory: DirOpt = None) -> None:
    """The SuperLink certificate (hosts, expiry) and every node key (SHA-256 fingerprint)."""
    creds = _creds(ctx, directory)
    cert = check_server(creds)
    console.print(f"SuperLink certificate for {', '.join(server_hosts(cert))}, valid until "
                  f"{cert.not_valid_after_utc:%Y-%m-%d}; CA {creds.ca_cert} until "
                  f"{x509.load_pem_x509_certificate(creds.ca_cert.read_bytes()).not_valid_after_utc:%Y-%m-%d}")
    if creds.admin_pub.exists():
        from quorumfl.privacy.admin import key_id, load_admin_publics

        ids = [key_id(k) for k in load_admin_publics(creds.admin_pub.read_bytes(), source=str(creds.admin_pub))]
        console.print(f"admin key {', '.join(ids)} ({creds.admin_pub}; private key "
                      f"{'here' if creds.admin_key.exists() else 'not on this machine'})", soft_wrap=True)
    rows = []
    for name in creds.node_names():
        digest = hashes.Hash(hashes.SHA256())
        digest.update(node_public_key(creds.node_pub(name)))
        rows.append({"node": name, "fingerprint": digest.finalize().hex()[:32], "key": str(creds.node_key(name))})
    console.print(table("Node keys", rows, ["node", "fingerprint", "key"]))
    if creds.retired():
        console.print(f"{len(creds.retired())} retired key(s) in {creds.root / 'retired'}")


@certs_app.command("flwr-login")
def flwr_login(
    ctx: typer.Context,
    superlink: Annotated[str, typer.Option(help="SuperLink HOST:PORT, as in the 'address' of Flower's config.toml.")] = DEFAULT_SUPERLINK,
    hours: Annotated[float, typer.Option(help="Hours the token stays valid (at most 8).")] = 8.0,
    directory: DirOpt = None,
) -> None:
    """Store an admin session token so Flower's own 'flwr' CLI can list runs and nodes, read logs and start runs.

    The admin-signed token for SUPERLINK goes into Flower's credential store
    ($FLWR_HOME/credentials.yaml). The SuperLink accepts it for those calls only: stopping runs
    and registering or removing nodes take 'quorumfl', which signs each call. Nodes still run only
    bundles the admin signed for one run ('quorumfl runs start', 'quorumfl certs sign-app')."""
    creds = _creds(ctx, directory)
    if not 0 < hours <= 8:
        raise typer.BadParameter(f"--hours must be in (0, 8], got {hours}")
    path = store_flwr_token(creds, superlink, ttl=hours * 3600)
    console.print(f"admin token for {superlink} stored in {path}, valid {hours:g} h", soft_wrap=True)


@certs_app.command("sign-app")
def sign_app(
    ctx: typer.Context,
    app_dir: Annotated[Path, typer.Argument(help="The Flower app directory (its pyproject.toml holds the run config).")],
    directory: DirOpt = None,
) -> None:
    """Sign a Flower app directory with the admin key, so nodes accept one 'flwr run APP_DIR'.

    A fresh run nonce, an expiry (6 hours), the roster version and (QuorumFL's app) the roster of
    the departments' keys are written into the pyproject.toml's run config first: nodes serve a signed run once, so sign again before each
    'flwr run'. Nodes refuse a run whose config differs from the signed pyproject.toml, so pass no
    '-c' overrides to 'flwr run': edit the pyproject and sign again."""
    target = sign_app_dir(app_dir.expanduser().resolve(), _creds(ctx, directory))
    console.print(f"signed {app_dir}: {target}", soft_wrap=True)
