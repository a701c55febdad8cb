"""Departments run only what the admin signed, even when the Control API is in other hands.

One real federation (SuperLink + 3 SuperNodes, TLS). The attacker holds a valid admin token (a stolen
Control API, or the coordinating server itself starting runs) but not the admin's private key, and
starts four runs: an unsigned bundle, a bundle signed by its own key, the admin's signed bundle with a
run-config override beside it (``secure-aggregation = none``), and a signed bundle with a code file
added. Every node refuses every one before any of the bundle is installed, with the reason; the
server records each refusal as the node's failure, and no round completes.

A signed run is good for one run: the admin's run completes, and the same StartRun bytes sent again,
a signed run past its expiry and one signed with an older roster are refused by every node; a run
stopped after its first round and resumed (a new signature, ``quorumfl runs resume``) completes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from flwr.common.serde import fab_to_proto, user_config_to_proto
from flwr.proto.control_pb2 import StartRunRequest

from quorumfl.core.data import prepare_partitions
from quorumfl.deploy.certs import roster_version
from quorumfl.deploy.control import app_pyproject, build_fab
from quorumfl.deploy.local import LocalFederation, local_federation
from quorumfl.deploy.resume import resume_run
from quorumfl.errors import NotFoundError
from quorumfl.privacy.admin import (
    SIGNATURE_FILE,
    SIGNED_RUN_VALID_S,
    load_admin_private,
    run_stamp,
    sign_app,
)
from quorumfl.server.config import DEFAULTS
from quorumfl.server.services import follow_run
from quorumfl.server.state.database import connect
from quorumfl.server.state.orm import Run
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus

pytestmark = pytest.mark.slow

DEPARTMENTS = ["tax-office", "urban-planning", "public-works"]


@dataclass
class Setup:
    home: Path
    repo: Repository
    federation: LocalFederation


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("signed")
    home = tmp / "home"
    db_url = f"sqlite:///{home / 'quorumfl.db'}"
    home.mkdir()
    repo = Repository(connect(db_url, migrate=True))
    parts = prepare_partitions(tmp / "data", DEPARTMENTS, seed=0, alpha=0.5)
    with local_federation(home, parts, db_url=db_url) as federation:
        yield Setup(home, repo, federation)


def _config(home: Path) -> dict[str, Any]:
    # The signatures are under test, not the department-alone check or the final fine-tuning: without
    # them each node trains once per round, as the timeouts here were set for (a loaded CI machine ran
    # the resumed run past its 300 s with them).
    return {**DEFAULTS, "num-rounds": 1, "local-epochs": 1, "round-timeout": 120.0, "train-retries": 0,
            "min-nodes": 2, "model-dir": str(home / "models"), "start-from": "fresh", "local-baseline": False,
            "finetune-epochs": 0}


def _signed(files: dict[str, bytes], key: Ed25519PrivateKey) -> dict[str, bytes]:
    return {**files, SIGNATURE_FILE: sign_app(files, key, now=time.time())}


def _start_with_stolen_token(s: Setup, files: dict[str, bytes], overrides: dict[str, Any]) -> int:
    """StartRun as the attacker makes it: a valid admin token (the federation's Control client adds
    it), a bundle of the attacker's choosing, overrides beside it."""
    request = StartRunRequest(fab=fab_to_proto(build_fab(files)), override_config=user_config_to_proto(overrides),
                              federation="")
    with s.federation.control._client() as client:
        response = client.StartRun(request)
    assert response.HasField("run_id"), "the SuperLink accepted the token, so it starts the run"
    return int(response.run_id)


def _assert_every_node_refused(s: Setup, flower_run_id: int, reason: str) -> Run:
    run = follow_run(s.repo, flower_run_id, timeout=300, alive=lambda: s.federation.alive(flower_run_id))
    assert run.status == RunStatus.FAILED, run.error
    assert [r.status for r in run.rounds] == [RoundStatus.FAILED]
    failures = run.rounds[0].failures
    assert len(failures) == len(DEPARTMENTS), [(f.node_id, f.reason) for f in failures]
    assert all(reason in f.reason for f in failures), [f.reason for f in failures]
    for name, child in s.federation.nodes.items():
        assert reason in child.log.read_text(errors="replace"), f"{name} did not log the refusal"
    return run


def test_an_unsigned_bundle_is_refused_by_every_node(setup: Setup) -> None:
    files = {"pyproject.toml": app_pyproject(_config(setup.home))}
    run_id = _start_with_stolen_token(setup, files, {})
    _assert_every_node_refused(setup, run_id, "not signed by the federation admin")


def test_a_bundle_signed_by_another_key_is_refused_by_every_node(setup: Setup) -> None:
    files = _signed({"pyproject.toml": app_pyproject(_config(setup.home))}, Ed25519PrivateKey.generate())
    run_id = _start_with_stolen_token(setup, files, {})
    _assert_every_node_refused(setup, run_id, "does not verify with the federation admin's key")


def test_an_override_beside_the_admins_signed_bundle_is_refused_by_every_node(setup: Setup) -> None:
    creds = setup.federation.credentials
    assert creds is not None
    admin = load_admin_private(creds.admin_key.read_bytes(), source="admin.key")
    config = {**_config(setup.home), "secure-aggregation": "masking"}
    files = _signed({"pyproject.toml": app_pyproject(config)}, admin)
    run_id = _start_with_stolen_token(setup, files, {"secure-aggregation": "none"})
    _assert_every_node_refused(setup, run_id, "run config differs from the one the admin signed (secure-aggregation)")


def test_code_added_to_a_signed_bundle_is_refused_by_every_node(setup: Setup) -> None:
    creds = setup.federation.credentials
    assert creds is not None
    admin = load_admin_private(creds.admin_key.read_bytes(), source="admin.key")
    files = _signed({"pyproject.toml": app_pyproject(_config(setup.home))}, admin)
    files["quorumfl_extra.py"] = b"import os\nos.system('echo exfiltrate')\n"
    run_id = _start_with_stolen_token(setup, files, {})
    _assert_every_node_refused(setup, run_id, "differs from what the admin signed: quorumfl_extra.py")


def test_the_admins_own_run_completes(setup: Setup) -> None:
    overrides = {k: v for k, v in _config(setup.home).items() if DEFAULTS.get(k) != v}
    run_id = setup.federation.control.start_run(overrides)
    run = follow_run(setup.repo, run_id, timeout=300, alive=lambda: setup.federation.alive(run_id))
    assert run.status == RunStatus.COMPLETED, f"{run.error}\n{setup.federation.logs()}"
    assert [(r.number, len(r.participants)) for r in run.rounds] == [(1, 3)]


def test_a_signed_run_serves_once_and_its_replay_an_expired_or_older_roster_run_are_refused(setup: Setup) -> None:
    control, creds = setup.federation.control, setup.federation.credentials
    assert creds is not None
    overrides = {k: v for k, v in _config(setup.home).items() if DEFAULTS.get(k) != v}
    request = control.start_request(overrides)
    run_id = control.submit(request)
    run = follow_run(setup.repo, run_id, timeout=300, alive=lambda: setup.federation.alive(run_id))
    assert run.status == RunStatus.COMPLETED, f"{run.error}\n{setup.federation.logs()}"

    replay = control.submit(request)  # the same bytes, with a valid token: a new Flower run
    _assert_every_node_refused(setup, replay, f"already served as run {run_id}")

    admin = load_admin_private(creds.admin_key.read_bytes(), source="admin.key")
    version = roster_version(creds)
    expired = run_stamp(now=time.time() - SIGNED_RUN_VALID_S - 60, roster_version=version)
    files = _signed({"pyproject.toml": app_pyproject({**_config(setup.home), **expired})}, admin)
    _assert_every_node_refused(setup, _start_with_stolen_token(setup, files, {}), "expired")

    older = run_stamp(now=time.time(), roster_version=version - 1)  # signed before the last key change
    files = _signed({"pyproject.toml": app_pyproject({**_config(setup.home), **older})}, admin)
    _assert_every_node_refused(setup, _start_with_stolen_token(setup, files, {}),
                               f"roster version {version - 1}, older than the version {version}")

    # A run interrupted after its first round is resumed by the admin: a new signature, a new nonce.
    interrupted = control.start_run({**overrides, "num-rounds": 3})
    stored = _wait(lambda: _completed_round(setup.repo, interrupted), "a first completed round")
    control.stop_run(interrupted)
    _wait(lambda: control.list_runs(interrupted)[0].status == "finished", "the stopped run to finish")
    resumed = resume_run(setup.repo, control, stored)
    run = follow_run(setup.repo, resumed, timeout=300, alive=lambda: setup.federation.alive(resumed))
    assert run.status == RunStatus.COMPLETED, f"{run.error}\n{setup.federation.logs()}"
    assert [r.number for r in run.rounds if r.status == RoundStatus.COMPLETED][-1] == 3


def _completed_round(repo: Repository, flower_run_id: int) -> int | None:
    """The QuorumFL id of the run once one of its rounds completed."""
    try:
        run = repo.get_run(flower_run_id)
    except NotFoundError:
        return None
    return run.id if any(r.status == RoundStatus.COMPLETED for r in repo.list_rounds(run.id)) else None


def _wait(check: Any, what: str, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")
