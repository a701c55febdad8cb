"""A signed run is good for one run: the node's ledger of served runs against replays, expired runs
and rosters older than a revocation, through ``app_guard.check_run`` as the ClientApp process calls it."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from quorumfl.deploy.app_guard import check_run
from quorumfl.deploy.control import app_pyproject, build_fab
from quorumfl.errors import CredentialError
from quorumfl.privacy.admin import SIGNED_RUN_VALID_S, run_stamp
from quorumfl.privacy.served_runs import ServedRuns, SignedRun
from quorumfl.server.config import DEFAULTS

ADMIN = Ed25519PrivateKey.generate()
ADMIN_PUB = ADMIN.public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
NOW = 1_800_000_000.0


def _signed(stamp: dict[str, str | int]) -> tuple[bytes, dict[str, object]]:
    """A bundle the admin signed with ``stamp``, and the run config Flower hands the ClientApp."""
    config = {**DEFAULTS, "num-rounds": 2, **stamp}
    return build_fab({"pyproject.toml": app_pyproject(config)}, admin_key=ADMIN).content, config


def test_a_signed_run_is_served_as_one_run_and_its_replay_is_refused(tmp_path: Path) -> None:
    fab, config = _signed(run_stamp(now=NOW, roster_version=3))
    ledger = ServedRuns(tmp_path)
    for _task in range(3):  # every task of the run: train, evaluate, the next round…
        check_run(fab, config, ADMIN_PUB, served=ledger, run_id=41, now=NOW + 60)
    check_run(fab, config, ADMIN_PUB, served=ledger, run_id=41, now=NOW + SIGNED_RUN_VALID_S + 3600)  # runs on
    with pytest.raises(CredentialError, match="already served as run 41; the same signature sent again as run 42"):
        check_run(fab, config, ADMIN_PUB, served=ServedRuns(tmp_path), run_id=42, now=NOW + 120)


def test_an_expired_signed_run_is_refused_by_a_node_that_never_served_it(tmp_path: Path) -> None:
    fab, config = _signed(run_stamp(now=NOW, roster_version=3))
    with pytest.raises(CredentialError, match="expired 1 s ago"):
        check_run(fab, config, ADMIN_PUB, served=ServedRuns(tmp_path), run_id=7, now=NOW + SIGNED_RUN_VALID_S + 1)
    check_run(fab, config, ADMIN_PUB, served=ServedRuns(tmp_path), run_id=7, now=NOW + SIGNED_RUN_VALID_S)


def test_a_run_signed_with_a_roster_older_than_one_seen_is_refused(tmp_path: Path) -> None:
    old_fab, old_config = _signed(run_stamp(now=NOW, roster_version=4))  # signed before a key was retired
    new_fab, new_config = _signed(run_stamp(now=NOW + 10, roster_version=5))
    ledger = ServedRuns(tmp_path)
    check_run(new_fab, new_config, ADMIN_PUB, served=ledger, run_id=8, now=NOW + 20)
    with pytest.raises(CredentialError, match="roster version 4, older than the version 5"):
        check_run(old_fab, old_config, ADMIN_PUB, served=ledger, run_id=9, now=NOW + 30)


def test_a_signed_run_without_a_stamp_is_refused(tmp_path: Path) -> None:
    fab, config = _signed({})
    with pytest.raises(CredentialError, match="no run nonce"):
        check_run(fab, config, ADMIN_PUB, served=ServedRuns(tmp_path), run_id=1, now=NOW)
    with pytest.raises(CredentialError, match="run-expires must be a whole number"):
        SignedRun({"run-nonce": "ab" * 16, "run-expires": 1.5, "roster-version": 0})


def test_an_unreadable_ledger_admits_nothing_and_is_left_as_it_was(tmp_path: Path) -> None:
    fab, config = _signed(run_stamp(now=NOW, roster_version=1))
    ledger = ServedRuns(tmp_path)
    ledger.path.write_text("{not json")
    with pytest.raises(CredentialError, match="unreadable"):
        check_run(fab, config, ADMIN_PUB, served=ledger, run_id=1, now=NOW)
    assert ledger.path.read_text() == "{not json"


def _admit(directory: str, nonce: str, run_id: int, results: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    try:
        ServedRuns(Path(directory)).admit(SignedRun({"run-nonce": nonce, "run-expires": int(time.time()) + 60,
                                                     "roster-version": 1}), run_id=run_id, now=time.time())
        results.put(run_id)
    except CredentialError:
        results.put(-run_id)


def test_two_processes_racing_to_serve_one_signed_run_as_two_runs_admit_one(tmp_path: Path) -> None:
    """A node's tasks run in several processes: the ledger's file lock lets exactly one first task
    claim a nonce, whatever the interleaving."""
    context = multiprocessing.get_context("fork")
    for attempt in range(5):
        nonce = f"{attempt:032x}"
        results: multiprocessing.Queue = context.Queue()  # type: ignore[type-arg]
        workers = [context.Process(target=_admit, args=(str(tmp_path), nonce, run_id, results)) for run_id in (1, 2, 3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
        outcomes = sorted(results.get(timeout=5) for _ in workers)
        assert sum(o > 0 for o in outcomes) == 1, outcomes
