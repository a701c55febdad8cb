"""Keep the SuperLink's registered SuperNode keys in step with the credentials folder.

Flower refuses every SuperNode whose key is not registered (``--enable-supernode-auth``). The
folder is the admin's record of who may join: each ``nodes/NAME.pub`` is registered under the name
NAME, each ``retired/*.pub`` (a rotated or revoked key) is unregistered, so a node holding it is cut
off at once and refused from then on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quorumfl.deploy.certs import Credentials, node_public_key
from quorumfl.deploy.control import Control
from quorumfl.server.state.repository import Repository

__all__ = ["RegistrationReport", "record_registrations", "sync_registrations"]


@dataclass
class RegistrationReport:
    registered: list[tuple[str, int]] = field(default_factory=list)  # newly registered (name, node id)
    unregistered: list[tuple[str, int]] = field(default_factory=list)  # retired keys cut off
    kept: list[tuple[str, int]] = field(default_factory=list)  # already registered


def sync_registrations(control: Control, creds: Credentials) -> RegistrationReport:
    report = RegistrationReport()
    active = {n.public_key: n for n in control.nodes() if n.status != "unregistered"}
    for path in creds.retired():
        node = active.pop(node_public_key(path), None)
        if node is not None:
            control.unregister_node(node.node_id)
            report.unregistered.append((node.name or path.stem, node.node_id))
    for name in creds.node_names():
        key = node_public_key(creds.node_pub(name))
        if key in active:
            report.kept.append((name, active[key].node_id))
            continue
        report.registered.append((name, control.register_node(key, name)))
    return report


def record_registrations(repo: Repository, report: RegistrationReport) -> list[str]:
    """List every registered node key in the state DB under its department, so `nodes list` shows the
    federation's departments before their first run; returns the names newly listed."""
    return [name for name, node in [*report.kept, *report.registered] if repo.record_registered(node, name)]
