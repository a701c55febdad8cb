"""Starting and stopping Flower's SuperLink and SuperNodes as child processes on this machine.

Every child runs in its own process group, so stopping it also ends the ClientApp/ServerApp
processes it spawned. ``ProcessGroup`` stops all of them on exit, on error and on Ctrl-C. Flower
starts its ServerApp and ClientApp processes in sessions of their own, and one can be spawned while
its parent is shutting down (then reparented to init), so the group also marks its children's
environment with a token of its own and stops every process that carries it: the process tree alone
would miss those.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from quorumfl.deploy.admin_access import ADMIN_KEYS_FLAG
from quorumfl.deploy.certs import Credentials
from quorumfl.deploy.launch_gate import write_superexec
from quorumfl.deploy.liveness import DEFAULT_HEARTBEAT_S, PARENT_ENV, offline_after
from quorumfl.deploy.signals import terminate_on_signals
from quorumfl.errors import ConfigError, CredentialError, FederationError

__all__ = [
    "REJOIN_GRACE_S",
    "REJOIN_RETRY_S",
    "Child",
    "NodeCredentials",
    "NodePresence",
    "ProcessGroup",
    "activated",
    "activation_refused",
    "flower_env",
    "flower_executable",
    "check_port_free",
    "free_port",
    "superlink_command",
    "tls_failed",
    "supernode_command",
    "terminate_on_signals",
    "wait_for_port",
]


GROUP_TOKEN = "QUORUMFL_PROCESS_GROUP"


def flower_executable(name: str) -> str:
    """Flower's command ``name`` from this interpreter's environment (else found on PATH)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def flower_env(home: Path, *, db_url: str | None = None) -> dict[str, str]:
    """Environment for Flower processes: no telemetry, no update check, no runtime installs, and
    ``HOME/run/bin`` first on PATH with the ``flower-superexec`` that reaps the app processes Flower
    starts (written here: call this only to start Flower processes)."""
    shims = write_superexec(home / "run" / "bin")
    env = dict(os.environ)
    env.update(
        {
            "FLWR_HOME": str(home / "flwr"),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "QUORUMFL_HOME": str(home),
            "PYTHONUNBUFFERED": "1",
            # Flower's SuperExec looks for new app tasks once a second by default; every message
            # round trip pays up to that wait again. (A SuperNode started as quorumfl.deploy.supernode
            # wakes its SuperExec instead: deploy/task_wake.py; this applies to the ServerApp's.)
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.25"),
            # Flower starts its helpers (flower-superexec, flwr-serverapp, flwr-clientapp) by name.
            "PATH": os.pathsep.join([str(shims), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        }
    )
    if db_url:
        env["QUORUMFL_DB_URL"] = db_url
    return env


def superlink_command(
    *, port: int, database: Path | None, host: str = "127.0.0.1", tls: Credentials | None = None
) -> list[str]:
    """``database=None`` keeps Flower's link state in memory: nothing to lock or clean up, which
    suits short-lived local federations (under load its SQLite state hit 'database is locked').
    ``tls``: the federation's credentials (TLS on the port, SuperNode authentication, a Control API
    that obeys only the admin's key); ``None`` runs insecure, for a trusted network only."""
    # The SuperLink runs under QuorumFL's entry point (admin_access), which answers for messages lost
    # to a node's restart and, with TLS, makes its Control API accept only admin-signed calls.
    launcher = [sys.executable, "-m", "quorumfl.deploy.admin_access",
                *([] if tls is None else [ADMIN_KEYS_FLAG, str(tls.admin_pub)])]
    cmd = [
        *launcher,
        *(["--database", str(database)] if database is not None else []),
        "--disable-runtime-dependency-installation",
        "--host", host,
        "--port", str(port),
    ]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
                "--ssl-keyfile", str(tls.server_key), "--enable-supernode-auth"]
    return cmd


@dataclass(frozen=True)
class NodeCredentials:
    """A node's side: the federation CA certificate and the node's own private key."""

    ca_cert: Path
    key: Path


class NodePresence:
    """This host's record of one node key while its SuperNode runs: an exclusive lock (one running
    node per key on a host; a second is refused at once) and a stamp refreshed while the node is
    connected. After a crash the SuperLink still counts the old SuperNode online and refuses the
    key for up to ``REJOIN_GRACE_S``; the stamp tells that case (worth waiting for) from a key the
    SuperLink does not know, revoked or in use elsewhere (refused at once: waiting changes nothing).
    """

    STAMP_EVERY_S = 5.0

    def __init__(self, folder: Path, identity: bytes) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        tag = hashlib.sha256(identity).hexdigest()[:16]
        self.lock_path = folder / f"node-{tag}.lock"
        self.stamp_path = folder / f"node-{tag}.connected"
        self._fd: int | None = None
        self._stamped = -math.inf

    def acquire(self, what: str) -> None:
        """Take the lock; a CredentialError naming the holder's pid when another node holds it."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise CredentialError(f"{what} already runs on this machine (pid {holder}) with this key: one key, one "
                              "running node; stop that one first, or give this node its own department's key") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None

    def connected(self) -> None:
        """The node is connected now (cheap to call often: writes every ``STAMP_EVERY_S``)."""
        now = time.monotonic()
        if now - self._stamped >= self.STAMP_EVERY_S:
            self.stamp_path.touch()
            self._stamped = now

    def seconds_since_connected(self) -> float | None:
        """How long ago this key's node was last connected from this host (None: never, or unknown)."""
        try:
            return max(0.0, time.time() - self.stamp_path.stat().st_mtime)
        except OSError:
            return None

    def rejoin_wait(self) -> float:
        """How long a refusal is worth retrying: what is left of the SuperLink's grace after the last
        time this key was connected from here (0 when it was not connected within the grace)."""
        ago = self.seconds_since_connected()
        return 0.0 if ago is None or ago >= REJOIN_GRACE_S else REJOIN_GRACE_S - ago


def supernode_command(
    *, superlink: str, port: int, data_path: Path, department: str, tls: NodeCredentials | None = None,
    node_config: Mapping[str, bool | int | float | str] | None = None,
) -> list[str]:
    """``node_config``: more node-config keys (``dp-budget``, ``train-workers``, …) as TOML values;
    ``tls``: verify the SuperLink against the CA and authenticate with the node key (``None``: insecure)."""
    config = f"data-path='{data_path}' department='{department}'"
    if tls is not None:  # the ClientApp signs its secure-aggregation keys with the node's registered key
        config += f" node-key='{tls.key}'"
    for key, value in (node_config or {}).items():
        shown = ("true" if value else "false") if isinstance(value, bool) else (
            f"'{value}'" if isinstance(value, str) else repr(value))
        config += f" {key}={shown}"
    cmd = [
        # Flower's SuperNode with its fixed 3 s idle poll shortened (quorumfl.deploy.supernode).
        sys.executable, "-m", "quorumfl.deploy.supernode",
        "--superlink", superlink,
        "--port", str(port),
        "--node-config", config,
    ]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--root-certificates", str(tls.ca_cert), "--auth-supernode-private-key", str(tls.key)]
    return cmd


def check_port_free(host: str, port: int) -> None:
    """Refuse, naming the port, when something already listens on ``host:port`` (so a server does
    not announce a port that another program answers on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server would: TIME_WAIT does not count
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"port {port} on {host or '0.0.0.0'} is not free ({exc.strerror}): another SuperLink or "
                              "program uses it; stop it or pass another --port") from exc


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, *, timeout: float, process: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise FederationError(f"process exited with code {process.returncode} before listening on {host}:{port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.2)
    raise FederationError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    log_offset: int = 0  # the log's size when this process started: its own output follows

    def output(self) -> str:
        """What this process (not an earlier one under the same name) has written to its log."""
        try:
            with open(self.log, "rb") as log:
                log.seek(self.log_offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""


# Flower's SuperLink answers "Failed to activate SuperNode" (exit 305) both to a key it does not know
# and to a key whose SuperNode it still counts as online. A SuperNode that was killed stays online
# there until its heartbeats have lapsed: two heartbeat intervals after the last one (10 s with
# QuorumFL's heartbeat, ``deploy.liveness``; a minute with Flower's own). A node started again within
# that window is refused; starting it again until the window has passed lets a crashed department
# rejoin under its own key. One that stopped cleanly was deactivated and rejoins at once.
ACTIVATION_REFUSED = "Failed to activate SuperNode"
ACTIVATED = "SuperNode ID:"
REJOIN_GRACE_S = offline_after(DEFAULT_HEARTBEAT_S) + 30
REJOIN_RETRY_S = 3.0


def activation_refused(child: Child) -> bool:
    """The SuperNode exited because the SuperLink refused to activate its key."""
    return child.process.poll() is not None and ACTIVATION_REFUSED in child.output()


TLS_FAILED = "SSL/TLS handshake error detected"


def tls_failed(child: Child) -> bool:
    """The SuperNode gave up because the SuperLink's certificate did not verify (Flower logs this)."""
    return child.process.poll() is not None and TLS_FAILED in child.output()


def activated(child: Child) -> bool:
    """The SuperLink has activated this SuperNode (it logged the node id it was given)."""
    return ACTIVATED in child.output()


class ProcessGroup:
    """Children started with ``start``; all are stopped by ``stop_all`` or on leaving the ``with``."""

    def __init__(self, log_dir: Path, env: dict[str, str]) -> None:
        self.log_dir = log_dir
        # Inherited by every process the children start (Flower passes its environment on).
        tag = secrets.token_hex(8)
        self.env = {**env, GROUP_TOKEN: tag}
        self._marker = f"{GROUP_TOKEN}={tag}".encode()  # as it appears in /proc/PID/environ
        self._since = _ticks_since_boot() - 1  # processes started before this group cannot be its members
        self.children: list[Child] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: Sequence[str], *, cwd: Path | None = None) -> Child:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            offset = log.tell()
            process = subprocess.Popen(
                list(cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env, PARENT_ENV: str(os.getpid())},  # it ends when this process does (liveness)
                cwd=cwd,
                start_new_session=True,
            )
        child = Child(name, process, log_path, offset)
        self.children.append(child)
        return child

    @staticmethod
    def kill(child: Child, sig: signal.Signals = signal.SIGKILL, *, group: bool = False) -> None:
        """Send ``sig`` to the child (or its whole process group)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(child.process.pid, sig)
            else:
                child.process.send_signal(sig)

    def stop_all(self, *, grace: float = 10.0) -> None:
        """SIGTERM every child's process group and every process carrying this group's token (its
        descendants, wherever they were reparented), again for any that appear meanwhile; then
        SIGKILL whatever is left after ``grace``."""
        for child in reversed(self.children):
            self.kill(child, signal.SIGTERM, group=True)
        signalled: set[int] = set()
        deadline = time.monotonic() + grace
        while True:
            members = self.members()
            _signal_pids(members - signalled, signal.SIGTERM)
            signalled |= members
            children_done = all(c.process.poll() is not None for c in self.children)
            if (children_done and not members) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        for _ in range(3):  # a process may still fork while being killed: repeat until none is left
            for child in self.children:
                self.kill(child, signal.SIGKILL, group=True)
            _signal_pids(self.members(), signal.SIGKILL)
            for child in self.children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(timeout=5)
            if not self.members():
                break
            time.sleep(0.1)
        self.children.clear()

    def members(self) -> set[int]:
        """Live processes (zombies excluded) below the children, and those started since this group
        began whose environment carries its token (reparented ones). Only those candidates' environ
        is read: reading another process's environ waits on its memory map lock, which a process
        busy in memory (a large training run beside us) can hold for long."""
        table = _process_table()
        tree = _below({c.process.pid for c in self.children}, table)
        candidates = {pid for pid, (_ppid, _state, start) in table.items() if start >= self._since and pid not in tree}
        return {pid for pid in tree | _with_environ(self._marker, candidates) if table[pid][1] not in ("Z", "X")}

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # A second Ctrl-C (or a stray SIGINT) during the clean-up must not cut it short and leave
        # orphans: the clean-up is bounded (grace + SIGKILL) anyway.
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
        try:
            self.stop_all()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def tail(self, child: Child, lines: int = 20) -> str:
        try:
            return "\n".join(child.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _ticks_since_boot() -> int:
    """Now, in the clock ticks of /proc/PID/stat's start time (0 where /proc is absent)."""
    try:
        return int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0


def _process_table() -> dict[int, tuple[int, str, int]]:
    """pid → (parent pid, state, start time in ticks since boot), from /proc (Linux; empty elsewhere)."""
    table: dict[int, tuple[int, str, int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            table[int(entry.name)] = (int(fields[1]), fields[0], int(fields[19]))
        except (OSError, ValueError, IndexError):
            continue
    return table


def _below(roots: set[int], table: dict[int, tuple[int, str, int]]) -> set[int]:
    found: set[int] = set()
    frontier = set(roots)
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in table.items() if ppid in frontier and pid not in found}
        found |= frontier
    return found


def _with_environ(entry: bytes, pids: set[int]) -> set[int]:
    """Those of ``pids`` (this user's) whose environment holds ``entry`` ("NAME=value")."""
    me = os.getpid()
    found: set[int] = set()
    for pid in pids:
        try:
            if pid != me and entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.add(pid)
        except OSError:
            continue
    return found


def _descendants(roots: set[int]) -> set[int]:
    """All processes below ``roots``, found through /proc (Linux); empty where /proc is absent."""
    return _below(roots, _process_table())


def stop_descendants(root: int, *, grace: float = 3.0) -> None:
    """SIGTERM every process below ``root``; SIGKILL those still there after ``grace`` seconds."""
    _signal_pids(_descendants({root}), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while (left := {p for p in _descendants({root}) if _process_table().get(p, (0, "Z", 0))[1] not in ("Z", "X")}):
        if time.monotonic() >= deadline:
            _signal_pids(left, signal.SIGKILL)
            return
        time.sleep(0.1)


def _signal_pids(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
