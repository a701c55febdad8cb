"""Client of the SuperLink's Control API: submit, list and stop runs of the QuorumFL app; list,
register and unregister SuperNode keys.

Submitting a run is what ``flwr run`` does: build a FAB (Flower app bundle) and call StartRun. The
QuorumFL code is installed on every SuperNode and on the SuperLink side, so the FAB carries only the
app's ``pyproject.toml`` (components and default run config) — a few hundred bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version as package_version
from typing import Any

import tomli_w
from flwr.cli.build import build_fab_from_files
from flwr.cli.cli_client_interceptor import CliClientHttpInterceptor
from flwr.common.serde import fab_to_proto, user_config_to_proto
from flwr.proto.control_pb2 import (
    ListNodesRequest,
    ListRunsRequest,
    RegisterNodeRequest,
    StartRunRequest,
    StopRunRequest,
    UnregisterNodeRequest,
)
from flwr.supercore.control import ControlHttpClient
from flwr.supercore.fab import Fab
from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

from quorumfl.aggregation.errors import FederationError

from .config import DEFAULTS

__all__ = ["Control", "FlowerNode", "FlowerRun", "app_pyproject", "build_fab"]


def app_pyproject() -> bytes:
    """The Flower app manifest of QuorumFL (same components and defaults as the repo's pyproject)."""
    manifest = {
        "build-system": {"requires": ["setuptools"], "build-backend": "setuptools.build_meta"},
        "project": {
            "name": "quorumfl",
            "version": package_version("quorumfl"),
            "description": "QuorumFL federation app",
            "dependencies": [],
        },
        "tool": {
            "flwr": {
                "app": {
                    "publisher": "quorumfl",
                    "components": {
                        "serverapp": "quorumfl.server.app:app",
                        "clientapp": "quorumfl.client.app:app",
                    },
                    "config": dict(DEFAULTS),
                }
            }
        },
    }
    return tomli_w.dumps(manifest).encode()


def build_fab(files: Mapping[str, bytes] | None = None) -> Fab:
    """A Flower app bundle: QuorumFL's manifest, or the given files (``pyproject.toml`` + code)."""
    fab_bytes, _ = build_fab_from_files(dict(files) if files is not None else {"pyproject.toml": app_pyproject()})
    return Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})


@dataclass(frozen=True)
class FlowerRun:
    run_id: int
    status: str
    sub_status: str
    details: str


@dataclass(frozen=True)
class FlowerNode:
    node_id: int
    name: str
    status: str
    public_key: bytes


class Control:
    """Thin typed wrapper over Flower's Control API HTTP client."""

    def __init__(self, address: str, *, insecure: bool = True, root_certificates: str | None = None) -> None:
        """``root_certificates``: path of the CA certificate that signed the SuperLink's TLS
        certificate (with ``insecure=False``)."""
        self.address = address
        self.insecure = insecure
        self.root_certificates = root_certificates

    @contextmanager
    def _client(self) -> Iterator[Any]:
        try:
            # What flwr's CLI builds, minus its account-login plugin and its banner on every call.
            client = ControlHttpClient.from_server_address(
                server_address=self.address,
                insecure=self.insecure,
                root_certificates=self.root_certificates,
                interceptors=[CliClientHttpInterceptor(), RuntimeVersionHttpInterceptor(component_name="flwr CLI")],
            )
        except Exception as exc:
            raise FederationError(f"cannot connect to the SuperLink at {self.address}: {exc}") from exc
        try:
            yield client
        except FederationError:
            raise
        except Exception as exc:
            raise FederationError(
                f"SuperLink Control API at {self.address} failed: {exc.__class__.__name__}: {exc}; "
                "is 'quorumfl server start' running there?"
            ) from exc
        finally:
            client.close()

    def start_run(self, overrides: Mapping[str, Any], *, fab: Fab | None = None) -> int:
        """Submit a run of the QuorumFL app (or of ``fab``, another Flower app bundle)."""
        request = StartRunRequest(
            fab=fab_to_proto(fab or build_fab()),
            override_config=user_config_to_proto(dict(overrides)),
            federation="",
        )
        with self._client() as client:
            response = client.StartRun(request)
        if not response.HasField("run_id"):
            raise FederationError(f"the SuperLink at {self.address} did not start the run")
        return int(response.run_id)

    def stop_run(self, run_id: int) -> None:
        with self._client() as client:
            response = client.StopRun(StopRunRequest(run_id=run_id))
        if not getattr(response, "success", True):
            raise FederationError(f"the SuperLink refused to stop run {run_id} (already finished?)")

    def list_runs(self, run_id: int | None = None) -> list[FlowerRun]:
        request = ListRunsRequest(run_id=run_id) if run_id is not None else ListRunsRequest()
        with self._client() as client:
            response = client.ListRuns(request)
        return [
            FlowerRun(int(key), run.status.status, run.status.sub_status, run.status.details)
            for key, run in response.run_dict.items()
        ]

    def run_finished(self, run_id: int) -> bool:
        """True once the SuperLink reports the run as finished (or does not know it)."""
        runs = self.list_runs(run_id)
        return not runs or runs[0].status == "finished"

    def online_nodes(self) -> list[int]:
        """Ids of the SuperNodes the SuperLink currently sees online."""
        with self._client() as client:
            response = client.ListNodes(ListNodesRequest())
        return [int(n.node_id) for n in response.nodes_info if n.status == "online"]

    def nodes(self) -> list[FlowerNode]:
        """Every SuperNode the SuperLink knows (registered keys and their status)."""
        with self._client() as client:
            response = client.ListNodes(ListNodesRequest())
        return [FlowerNode(int(n.node_id), n.name if n.HasField("name") else "", n.status, bytes(n.public_key))
                for n in response.nodes_info]

    def register_node(self, public_key: bytes, name: str) -> int:
        """Register a SuperNode's public key (PEM SubjectPublicKeyInfo); returns its node id."""
        with self._client() as client:
            response = client.RegisterNode(RegisterNodeRequest(public_key=public_key, name=name))
        if not response.node_id:
            raise FederationError(f"the SuperLink at {self.address} did not register node {name!r}")
        return int(response.node_id)

    def unregister_node(self, node_id: int) -> None:
        with self._client() as client:
            client.UnregisterNode(UnregisterNodeRequest(node_id=node_id))
