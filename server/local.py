"""A whole federation on this machine: one SuperLink and one SuperNode per department directory,
as separate processes on 127.0.0.1 (Flower's deployment engine). Used by the demo, the
integration tests and the benchmarks; every process is stopped when the ``with`` block ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quorumfl.aggregation.errors import FederationError

from .control import Control
from .processes import (
    Child,
    ProcessGroup,
    flower_env,
    free_port,
    superlink_command,
    supernode_command,
    wait_for_port,
)

__all__ = ["LocalFederation", "local_federation"]


@dataclass
class LocalFederation:
    address: str
    control: Control
    group: ProcessGroup
    link: Child
    nodes: dict[str, Child]

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- {c.name} ({c.log})\n{self.group.tail(c, lines)}" for c in self.group.children)

    def add_node(self, name: str, data_path: Path, *, superlink: str | None = None) -> Child:
        """Start one more SuperNode (e.g. a department's node again after it crashed); ``superlink``:
        another address that reaches the SuperLink (a department behind a proxy)."""
        child = self.group.start(
            name, supernode_command(superlink=superlink or self.address, port=free_port(), data_path=data_path,
                                    department=name)
        )
        self.nodes[name] = child
        return child

    def alive(self, flower_run_id: int) -> bool:
        """The SuperLink runs and has not yet marked the run finished."""
        return self.link.process.poll() is None and not self.control.run_finished(flower_run_id)


@contextmanager
def local_federation(
    home: Path, departments: dict[str, Path], *, db_url: str, connect_timeout: float = 120.0,
    node_config: Mapping[str, bool | int | float | str] | None = None,
) -> Iterator[LocalFederation]:
    """Start the SuperLink (Flower's link state in memory) and the SuperNodes, with logs under
    ``home``; wait until all nodes are online. ``node_config``: more node-config keys for every node."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    with ProcessGroup(home / "logs", flower_env(home, db_url=db_url)) as group:
        link = group.start("superlink", superlink_command(port=port, database=None))
        try:
            wait_for_port("127.0.0.1", port, timeout=60, process=link.process)
        except FederationError as exc:
            raise FederationError(f"{exc}\n{group.tail(link)}") from exc
        nodes = {
            name: group.start(name, supernode_command(superlink=address, port=free_port(), data_path=path, department=name,
                                                      node_config=node_config))
            for name, path in departments.items()
        }
        federation = LocalFederation(address, Control(address), group, link, nodes)
        deadline = time.monotonic() + connect_timeout
        while (online := len(federation.control.online_nodes())) < len(nodes):
            if time.monotonic() > deadline:
                raise FederationError(f"only {online} of {len(nodes)} SuperNodes connected\n{federation.logs()}")
            time.sleep(0.5)
        yield federation
