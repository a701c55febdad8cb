"""A whole federation on this machine: one SuperLink and one SuperNode per department directory,
as separate processes on 127.0.0.1 (Flower's deployment engine). Used by the demo, the
integration tests and the benchmarks; every process is stopped when the ``with`` block ends.

Like ``quorumfl server start``, it runs with TLS and SuperNode authentication unless told
otherwise: credentials for 127.0.0.1, the admin key and one key per department are made under
``HOME/certs`` (kept for the next federation in the same home), and each key is registered before
its node starts. The Control client signs every call and every run with the admin key, and the
nodes run only admin-signed apps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from quorumfl.deploy.app_guard import app_guard_env
from quorumfl.deploy.certs import Credentials, add_admin_key, add_node_key, init_credentials
from quorumfl.deploy.control import Control
from quorumfl.deploy.host_slots import host_slot_env
from quorumfl.deploy.processes import (
    REJOIN_GRACE_S,
    REJOIN_RETRY_S,
    Child,
    NodeCredentials,
    ProcessGroup,
    activated,
    activation_refused,
    flower_env,
    free_port,
    superlink_command,
    supernode_command,
    wait_for_port,
)
from quorumfl.deploy.registration import sync_registrations
from quorumfl.deploy.supernode import DEFAULT_POLL_S, POLL_ENV
from quorumfl.deploy.warm import warm_env
from quorumfl.errors import FederationError

__all__ = ["LocalFederation", "local_federation"]


@dataclass
class LocalFederation:
    address: str
    control: Control
    group: ProcessGroup
    link: Child
    nodes: dict[str, Child]
    credentials: Credentials | None = None
    node_config: Mapping[str, bool | int | float | str] | None = None
    _closing: threading.Event = field(default_factory=threading.Event)
    _starting: threading.Lock = field(default_factory=threading.Lock)
    _rejoining: list[threading.Thread] = field(default_factory=list)

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- {c.name} ({c.log})\n{self.group.tail(c, lines)}" for c in self.group.children)

    def add_node(self, name: str, data_path: Path, *, superlink: str | None = None) -> Child:
        """Start one more SuperNode (e.g. a department's node again after it crashed); ``superlink``:
        another address that reaches the SuperLink (a department behind a proxy).

        A department that comes back under its own key is refused by the SuperLink until its crashed
        SuperNode's heartbeats have lapsed (``REJOIN_GRACE_S``); a background thread starts it again
        until it is activated, so the caller does not wait. ``nodes[name]`` is the latest process."""

        def start() -> Child:
            return self.group.start(name, supernode_command(
                superlink=superlink or self.address, port=free_port(), data_path=data_path,
                department=name, tls=self.node_credentials(name), node_config=self.node_config))

        child = start()
        self.nodes[name] = child
        thread = threading.Thread(target=self._rejoin, args=(name, start), name=f"rejoin-{name}", daemon=True)
        self._rejoining.append(thread)
        thread.start()
        return child

    def _rejoin(self, name: str, start: Callable[[], Child]) -> None:
        deadline = time.monotonic() + REJOIN_GRACE_S
        child = self.nodes[name]
        while not self._closing.is_set() and not activated(child):
            if child.process.poll() is not None:
                if not activation_refused(child) or time.monotonic() > deadline:
                    return  # another failure, or refused for good: the caller sees the exited process
                if self._closing.wait(REJOIN_RETRY_S):
                    return
                with self._starting:
                    if self._closing.is_set():
                        return
                    child = self.nodes[name] = start()
            time.sleep(0.2)

    def close(self) -> None:
        """Stop restarting nodes (the ``with`` block ends): no process starts after the group stops."""
        with self._starting:
            self._closing.set()
        for thread in self._rejoining:
            thread.join(timeout=10)

    def node_credentials(self, name: str) -> NodeCredentials | None:
        """The node's CA + key (made and registered if new); None in an insecure federation."""
        creds = self.credentials
        if creds is None:
            return None
        if not creds.node_pub(name).exists():
            add_node_key(creds, name)
            sync_registrations(self.control, creds)
        return NodeCredentials(creds.ca_cert, creds.node_key(name))

    def alive(self, flower_run_id: int) -> bool:
        """The SuperLink runs and has not yet marked the run finished. A Control API call that fails
        while the SuperLink process runs (a TLS handshake timing out on a loaded machine) counts as
        alive: the caller asks again, and a dead SuperLink is seen by its process."""
        if self.link.process.poll() is not None:
            return False
        try:
            return not self.control.run_finished(flower_run_id)
        except FederationError:
            return True


@contextmanager
def local_federation(
    home: Path, departments: dict[str, Path], *, db_url: str, connect_timeout: float = 120.0,
    node_config: Mapping[str, bool | int | float | str] | None = None, tls: bool = True,
    clientapp_slots: int = 0, node_nice: int = 0, warm_clientapps: bool = True, node_poll_s: float | None = None,
) -> Iterator[LocalFederation]:
    """Start the SuperLink (Flower's link state in memory) and the
    SuperNodes, with logs under ``home``; wait until all nodes are online. ``node_config``: more
    node-config keys for every node; ``tls=False``: no TLS and no node authentication;
    ``clientapp_slots``: at most this many ClientApps train at once on this machine (0: no limit);
    ``node_nice``: run the SuperNodes (and their ClientApps) at this lower CPU priority, so that many
    nodes sharing a few cores do not starve the SuperLink's TLS handshakes; ``warm_clientapps``:
    fork each ClientApp from one warm process (``quorumfl.deploy.warm``) instead of starting a fresh
    interpreter per message; ``node_poll_s``: seconds between an idle SuperNode's requests for new
    messages (``quorumfl.deploy.supernode``; Flower's own loop waits 3 s). By default 0.5 s, longer
    for many nodes so that the SuperLink answers about 20 idle polls a second in all (50 nodes: 2.5 s)."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    creds = None
    if tls:
        creds = Credentials(home / "certs")
        if not creds.ca_cert.exists():
            init_credentials(creds.root, hosts=["127.0.0.1", "localhost"], nodes=[])
        if not creds.admin_key.exists():  # a credentials folder made before admin keys existed
            add_admin_key(creds)
        for name in departments:
            if not creds.node_pub(name).exists():
                add_node_key(creds, name)
    env = flower_env(home, db_url=db_url)
    if clientapp_slots:
        env.update(host_slot_env(clientapp_slots, home / "clientapp-slots", path=env["PATH"]))
    if creds is not None:  # nodes run only apps the admin signed
        env.update(app_guard_env(creds.admin_pub, home / "clientapp-guard", path=env["PATH"]))
    if warm_clientapps:  # ClientApps forked from a process with torch, Flower and QuorumFL imported
        env.update(warm_env(home / "clientapp-warm", path=env["PATH"], env=env))
    env[POLL_ENV] = str(node_poll_s if node_poll_s is not None else min(3.0, max(DEFAULT_POLL_S, len(departments) / 20)))
    with ProcessGroup(home / "logs", env) as group:
        link = group.start("superlink", superlink_command(port=port, database=None, tls=creds))
        try:
            wait_for_port("127.0.0.1", port, timeout=60, process=link.process)
        except FederationError as exc:
            raise FederationError(f"{exc}\n{group.tail(link)}") from exc
        control = Control.for_federation(address, creds)
        if creds is not None:
            sync_registrations(control, creds)
        federation = LocalFederation(address, control, group, link, {}, creds, node_config)
        nice = ["nice", "-n", str(node_nice)] if node_nice else []

        def start_node(name: str) -> Child:
            return group.start(name, nice + supernode_command(
                superlink=address, port=free_port(), data_path=departments[name], department=name,
                tls=federation.node_credentials(name), node_config=node_config))

        for name in departments:
            federation.nodes[name] = start_node(name)
        nodes = federation.nodes
        restarts = 0
        deadline = time.monotonic() + connect_timeout
        while (online := len(federation.control.online_nodes())) < len(nodes):
            if time.monotonic() > deadline:
                raise FederationError(f"only {online} of {len(nodes)} SuperNodes connected\n{federation.logs()}")
            for name, child in list(nodes.items()):
                # A node's local port, free when picked, can be taken before it binds (many nodes
                # starting at once): start it again on another port, a few times at most.
                if child.process.poll() is not None and restarts < 3 * len(nodes):
                    restarts += 1
                    group.children.remove(child)
                    nodes[name] = start_node(name)
            time.sleep(0.5)
        try:
            yield federation
        finally:
            federation.close()
