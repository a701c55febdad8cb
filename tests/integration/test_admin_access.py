"""The attacker on the server's port: the Control API obeys only the admin's key.

A real SuperLink (TLS, node authentication, QuorumFL's admin-token plugin) listens on 127.0.0.2; the
caller that tries it is another address on the machine's loopback network (127.0.0.3), speaking
Flower's own protobuf-over-HTTP Control protocol with the federation's public CA certificate, as any
department (or anyone who got a copy of ``ca.crt``) could. Every admin call is refused without an
admin-signed token (with a forged, expired or foreign-federation one too), and the same calls work
with the admin's token. A token serves the one call it was signed for, once: replayed, or used for
another call, it is refused; a session token for Flower's CLI lists runs but registers no node; and
the API's schema and documentation pages are not served.
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
from quorumfl.privacy.admin import call_digest, federation_id, issue_token, load_admin_private

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
                 now: float | None = None, ttl: float = 300, call: tuple[str, object] | None = None) -> str:
    """An admin token; ``call``: (path, request) of the one call it is bound to (none: a session token)."""
    key = key or load_admin_private(link.creds.admin_key.read_bytes(), source="admin.key")
    digest = "" if call is None else call_digest(
        "POST", f"/v1/control/{call[0]}", call[1].SerializeToString())  # type: ignore[attr-defined]
    return issue_token(key, audience=audience or federation_id(link.creds.ca_cert.read_bytes()),
                       now=time.time() if now is None else now, ttl=ttl, call=digest)


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

    # The same calls with the admin's token for each call, from the same address, work.
    def signed(path: str, request: object) -> httpx.Response:
        return _call(link, path, request, _admin_token(link, call=(path, request)))

    started = StartRunResponse.FromString(signed("start-run", _requests(link, run_id)["start-run"]).content)
    assert started.HasField("run_id")
    assert signed("stop-run", StopRunRequest(run_id=run_id)).status_code == 200
    listed = ListRunsResponse.FromString(signed("list-runs", ListRunsRequest()).content)
    assert set(listed.run_dict) == {run_id, started.run_id}
    assert listed.run_dict[run_id].status.sub_status == "stopped"
    request = RegisterNodeRequest(public_key=node_public_key(link.creds.node_pub("intruder")), name="ok")
    assert signed("register-node", request).status_code == 200
    assert [n.name for n in admin.nodes()] == ["ok"]


def test_a_token_serves_its_one_call_once(link: Link) -> None:
    """A captured token, replayed: refused. A token for list-runs, presented for register-node (or for
    list-runs with another body): refused. A session token (flwr-login): lists runs, registers nothing."""
    admin = Control(link.address, insecure=False, root_certificates=str(link.creds.ca_cert),
                    admin_key=link.creds.admin_key)
    listing = ListRunsRequest()
    token = _admin_token(link, call=("list-runs", listing))
    assert _call(link, "list-runs", listing, token).status_code == 200
    replayed = _call(link, "list-runs", listing, token)
    assert replayed.status_code == 401 and "already used" in replayed.text, replayed.text
    add_node_key(link.creds, "intruder")
    register = RegisterNodeRequest(public_key=node_public_key(link.creds.node_pub("intruder")), name="intruder")
    for_listing = _admin_token(link, call=("list-runs", listing))
    moved = _call(link, "register-node", register, for_listing)
    assert moved.status_code == 401 and "another call" in moved.text, moved.text
    other_body = _call(link, "list-runs", ListRunsRequest(run_id=5), _admin_token(link, call=("list-runs", listing)))
    assert other_body.status_code == 401 and "another call" in other_body.text
    session = _admin_token(link, ttl=3600)
    assert _call(link, "list-runs", listing, session).status_code == 200
    assert _call(link, "list-runs", listing, session).status_code == 200  # a session token is reused by flwr
    refused = _call(link, "register-node", register, session)
    assert refused.status_code == 401 and "session token" in refused.text, refused.text
    too_long = _admin_token(link, ttl=3600, call=("list-runs", listing))
    assert _call(link, "list-runs", listing, too_long).status_code == 401  # a call-bound token lives 300 s at most
    assert admin.nodes() == []  # nothing registered


def test_the_api_schema_and_documentation_pages_are_not_served(link: Link) -> None:
    context = ssl.create_default_context(cafile=str(link.creds.ca_cert))
    transport = httpx.HTTPTransport(verify=context, local_address=ATTACKER_HOST)
    with httpx.Client(transport=transport, timeout=20) as client:
        for page in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
            response = client.get(f"https://{link.address}{page}")
            assert response.status_code == 404, (page, response.status_code, response.text[:200])


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
                               headers={"Content-Type": "application/protobuf",
                                        "Authorization": f"Bearer {_admin_token(link, call=('list-runs', ListRunsRequest()))}"})
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
