"""The attacker on the server's port: the Control API obeys only the admin's key.

A real SuperLink (TLS, node authentication, QuorumFL's admin-token plugin) listens on 127.0.0.2; the
caller that tries it is another address on the machine's loopback network (127.0.0.3), speaking
Flower's own protobuf-over-HTTP Control protocol with the federation's public CA certificate, as any
department (or anyone who got a copy of ``ca.crt``) could. Every admin call is refused without an
admin-signed token (with a forged, expired or foreign-federation one too), and the same calls work
with the admin's token.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.common.serde import fab_to_proto, user_config_to_proto
from flwr.proto.control_pb2 import (
    ListRunsRequest,
    ListRunsResponse,
    RegisterNodeRequest,
    StartRunRequest,
    StartRunResponse,
    StopRunRequest,
)
from flwr.supercore.version import package_version

from quorumfl.deploy.certs import Credentials, add_node_key, init_credentials, node_public_key
from quorumfl.deploy.control import Control, build_fab
from quorumfl.deploy.processes import flower_env, free_port, superlink_command, wait_for_port
from quorumfl.errors import CredentialError
from quorumfl.privacy.admin import federation_id, issue_token, load_admin_private

LINK_HOST = "127.0.0.2"
ATTACKER_HOST = "127.0.0.3"


class Link:
    def __init__(self, creds: Credentials, port: int) -> None:
        self.creds, self.port = creds, port
        self.address = f"{LINK_HOST}:{port}"


@pytest.fixture
def link(tmp_path: Path) -> Iterator[Link]:
    creds = init_credentials(tmp_path / "certs", hosts=[LINK_HOST], nodes=[])
    port = free_port(LINK_HOST)
    log = (tmp_path / "superlink.log").open("wb")
    process = subprocess.Popen(superlink_command(port=port, database=None, host=LINK_HOST, tls=creds),
                               env=flower_env(tmp_path), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(LINK_HOST, port, timeout=60, process=process)
        yield Link(creds, port)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def _call(link: Link, path: str, request: object, token: str | None) -> httpx.Response:
    """One Control API call from the attacker's address, as Flower's CLI makes it (headers included)."""
    context = ssl.create_default_context(cafile=str(link.creds.ca_cert))
    headers = {"Content-Type": "application/protobuf", "flwr-client": "cli",
               "flwr-component-name": "flwr CLI", "flwr-package-version": package_version}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    transport = httpx.HTTPTransport(verify=context, local_address=ATTACKER_HOST)
    with httpx.Client(transport=transport, timeout=20) as client:
        return client.post(f"https://{link.address}/v1/control/{path}", content=request.SerializeToString(),  # type: ignore[attr-defined]
                           headers=headers)


def _requests(link: Link, run_id: int) -> dict[str, object]:
    if not link.creds.node_pub("intruder").exists():
        add_node_key(link.creds, "intruder")
    return {
        "register-node": RegisterNodeRequest(public_key=node_public_key(link.creds.node_pub("intruder")), name="intruder"),
        "start-run": StartRunRequest(fab=fab_to_proto(build_fab()), override_config=user_config_to_proto({}), federation=""),
        "stop-run": StopRunRequest(run_id=run_id),
        "list-runs": ListRunsRequest(),
    }


def _admin_token(link: Link, *, key: Ed25519PrivateKey | None = None, audience: str | None = None,
                 now: float | None = None, ttl: float = 300) -> str:
    key = key or load_admin_private(link.creds.admin_key.read_bytes(), source="admin.key")
    return issue_token(key, audience=audience or federation_id(link.creds.ca_cert.read_bytes()),
                       now=time.time() if now is None else now, ttl=ttl)


def test_admin_calls_from_another_address_are_refused_without_the_admin_token(link: Link) -> None:
    admin = Control(link.address, insecure=False, root_certificates=str(link.creds.ca_cert),
                    admin_key=link.creds.admin_key)
    run_id = admin.start_run({"num-rounds": 1})  # a run the attacker will try to stop
    forged = [
        None,  # no credential at all
        "qfl1.e30.AAAA",  # garbage in the right shape
        _admin_token(link, key=Ed25519PrivateKey.generate()),  # someone's own key
        _admin_token(link, audience="0" * 64),  # the admin's key, another federation
        _admin_token(link, now=time.time() - 3600, ttl=300),  # the admin's key, expired an hour ago
    ]
    for path, request in _requests(link, run_id).items():
        for token in forged:
            response = _call(link, path, request, token)
            assert response.status_code == 401, (path, token, response.status_code, response.text)
    runs = admin.list_runs()  # nothing was stopped (the SuperLink's own SuperExec may have started it)
    assert [r.run_id for r in runs] == [run_id] and runs[0].status in ("pending", "starting", "running"), runs
    assert admin.nodes() == []  # nor registered

    # The same calls with the admin's token, from the same address, work.
    token = _admin_token(link)
    started = StartRunResponse.FromString(_call(link, "start-run", _requests(link, run_id)["start-run"], token).content)
    assert started.HasField("run_id")
    assert _call(link, "stop-run", StopRunRequest(run_id=run_id), token).status_code == 200
    listed = ListRunsResponse.FromString(_call(link, "list-runs", ListRunsRequest(), token).content)
    assert set(listed.run_dict) == {run_id, started.run_id}
    assert listed.run_dict[run_id].status.sub_status == "stopped"
    request = RegisterNodeRequest(public_key=node_public_key(link.creds.node_pub("intruder")), name="ok")
    assert _call(link, "register-node", request, token).status_code == 200
    assert [n.name for n in admin.nodes()] == ["ok"]


def test_the_quorumfl_client_without_the_admin_key_gets_one_clear_error(link: Link) -> None:
    anonymous = Control(link.address, insecure=False, root_certificates=str(link.creds.ca_cert))
    with pytest.raises(CredentialError, match="admin's key"):
        anonymous.list_runs()


def test_a_tls_superlink_without_admin_keys_refuses_to_start(tmp_path: Path) -> None:
    creds = init_credentials(tmp_path / "certs", hosts=["127.0.0.1"], nodes=[])
    creds.admin_pub.unlink()
    cmd = superlink_command(port=free_port(), database=None, tls=creds)
    result = subprocess.run(cmd, env=flower_env(tmp_path), capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 78, result.stdout + result.stderr
    assert "admin.pub" in result.stderr


def test_the_runtime_api_refuses_callers_from_other_addresses(link: Link) -> None:
    """Flower leaves its Runtime API unauthenticated in subprocess isolation, on the same port: a
    caller from elsewhere could take a pending ServerApp task and act as the run's server."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest

    admin = Control(link.address, insecure=False, root_certificates=str(link.creds.ca_cert),
                    admin_key=link.creds.admin_key)
    admin.start_run({"num-rounds": 1})  # a pending ServerApp task to steal
    context = ssl.create_default_context(cafile=str(link.creds.ca_cert))
    transport = httpx.HTTPTransport(verify=context, local_address=ATTACKER_HOST)
    with httpx.Client(transport=transport, timeout=20) as client:
        response = client.post(f"https://{link.address}/v1/runtime/acquire-task",
                               content=AcquireTaskRequest().SerializeToString(),
                               headers={"Content-Type": "application/protobuf", "Authorization": f"Bearer {_admin_token(link)}"})
    assert response.status_code == 403, (response.status_code, response.text)


def test_control_calls_dressed_as_fleet_or_runtime_paths_are_not_obeyed(link: Link) -> None:
    """The SuperLink skips its Control-only layers (authentication among them) for Fleet and Runtime
    paths; a Control call whose raw path merely starts like one must not reach a Control handler."""
    import http.client

    admin = Control(link.address, insecure=False, root_certificates=str(link.creds.ca_cert),
                    admin_key=link.creds.admin_key)
    run_id = admin.start_run({"num-rounds": 1})
    body = StopRunRequest(run_id=run_id).SerializeToString()
    context = ssl.create_default_context(cafile=str(link.creds.ca_cert))
    for path in ("/v1/fleet/../control/stop-run", "/v1/runtime/../control/stop-run", "/v1/fleet/%2e%2e/control/stop-run",
                 "/v1/fleet//v1/control/stop-run"):
        connection = http.client.HTTPSConnection(LINK_HOST, link.port, context=context, timeout=20,
                                                 source_address=(ATTACKER_HOST, 0))
        try:
            connection.request("POST", path, body=body, headers={"Content-Type": "application/protobuf"})
            status = connection.getresponse().status
        finally:
            connection.close()
        assert status in (401, 403, 404), (path, status)
    runs = admin.list_runs()
    assert [r.run_id for r in runs] == [run_id] and runs[0].status in ("pending", "starting", "running"), runs
