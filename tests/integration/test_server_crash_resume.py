"""``kill -9`` of the whole server side (the ``quorumfl server start`` process, its SuperLink and the
ServerApp), or Ctrl-C of ``server start``, in the middle of a round; ``server start`` again resumes the
run from the last completed round: nothing that was completed is lost, the interrupted round is
recorded as aborted and redone.

Real processes on 127.0.0.1, with TLS and node authentication (the defaults).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quorumfl.deploy.processes import ProcessGroup, _descendants, free_port, wait_for_port
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus

DEPARTMENTS = ["tax-office", "parks", "housing"]


def _cli(home: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "quorumfl.cli", "--home", str(home), *args]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone
        return b""


def _snapshot(repo: Repository, run_id: int) -> dict[str, object]:
    """Everything a completed round left in the DB: round rows, model versions, metrics."""
    rounds = [(r.id, r.number, r.attempt, r.status, tuple(sorted(r.participants))) for r in repo.list_rounds(run_id)
              if r.status == RoundStatus.COMPLETED]
    versions = [(v.id, v.round, v.sha256, v.parent_id) for v in repo.list_model_versions(run_id=run_id)]
    metrics = sorted((m.round, m.node_id or 0, m.name, m.value) for m in repo.metrics(run_id))
    return {"rounds": rounds, "versions": versions, "metrics": metrics}


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["kill-9", "ctrl-c"])
def test_a_server_stopped_mid_round_resumes_the_run_and_loses_no_completed_round(tmp_path: Path, stop: str) -> None:
    home = tmp_path / "home"
    port = free_port()
    address = f"127.0.0.1:{port}"
    for step in (["data", "split", "--out", str(tmp_path / "parts"), "--departments", ",".join(DEPARTMENTS),
                  "--method", "iid"], ["certs", "init", "--nodes", ",".join(DEPARTMENTS)]):
        done = subprocess.run(_cli(home, *step), capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    repo = Repository(connect(f"sqlite:///{home / 'quorumfl.db'}", migrate=True))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with ProcessGroup(tmp_path / "logs", env) as group:

        def logs() -> str:
            return "\n".join(f"--- {c.name}\n{group.tail(c, 25)}" for c in group.children)

        # As from a terminal: Ctrl-C must reach `server start` as a KeyboardInterrupt. A test runner
        # started in the background (`.ci/run &`) ignores SIGINT, and an ignored signal stays ignored
        # in a child; a handled one is reset to the default at exec.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            server = group.start("server-1", _cli(home, "server", "start", "--port", str(port)))
        finally:
            signal.signal(signal.SIGINT, previous)
        wait_for_port("127.0.0.1", port, timeout=90, process=server.process)
        for dept in DEPARTMENTS:
            group.start(dept, _cli(home, "node", "start", "--department", dept, "--data", str(tmp_path / "parts" / dept),
                                   "--superlink", address))
        config = tmp_path / "run.toml"
        config.write_text('[run]\nstrategy = "fedavg"\nnum-rounds = 4\nlocal-epochs = 2\nstart-from = "fresh"\n'
                          'min-nodes = 3\n')
        started = subprocess.run(_cli(home, "runs", "start", str(config), "--superlink", address),
                                 capture_output=True, text=True, timeout=120, check=False)
        assert started.returncode == 0, started.stdout + started.stderr

        # Wait until round 2 is completed and round 3 is under way, then kill -9 the server side.
        deadline = time.monotonic() + 400
        while True:
            assert time.monotonic() < deadline, f"round 3 never started\n{logs()}"
            runs = repo.list_runs()
            if runs and any(r.number == 3 and r.status == RoundStatus.RUNNING for r in repo.list_rounds(runs[0].id)):
                break
            time.sleep(0.1)
        run_id = runs[0].id
        before = _snapshot(repo, run_id)
        victims = {server.process.pid} | _descendants({server.process.pid})
        assert any(b"flwr-serverapp" in Path(f"/proc/{p}/cmdline").read_bytes() for p in victims
                   if Path(f"/proc/{p}").exists()), "no ServerApp process to kill"
        if stop == "kill-9":  # the whole server side at once: nobody is left to record anything
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            server.process.wait(timeout=30)
        else:  # Ctrl-C of 'server start': it stops its SuperLink, whose ServerApp ends its run as interrupted
            server.process.send_signal(signal.SIGINT)
            assert server.process.wait(timeout=90) == 130, logs()
            deadline = time.monotonic() + 60
            while any(b"flwr-serverapp" in _cmdline(p) for p in victims):
                assert time.monotonic() < deadline, f"the ServerApp outlived its server\n{logs()}"
                time.sleep(0.2)
        assert [r.number for r in repo.list_rounds(run_id) if r.status == RoundStatus.COMPLETED] == [1, 2]
        assert repo.get_run(run_id).status == RunStatus.RUNNING, repo.get_run(run_id).error  # resumable, not failed

        # Restart: the same home, port and SuperLink database.
        restarted = group.start("server-2", _cli(home, "server", "start", "--port", str(port)))
        deadline = time.monotonic() + 600
        while repo.get_run(run_id).status == RunStatus.RUNNING:
            assert time.monotonic() < deadline, f"the resumed run did not finish\n{logs()}"
            assert restarted.process.poll() is None, logs()
            time.sleep(1.0)
        assert "was interrupted; resumed as Flower run" in group.tail(restarted, 200)

    run = repo.get_run(run_id)
    assert run.status == RunStatus.COMPLETED, f"{run.status}: {run.error}\n{logs()}"
    after = _snapshot(repo, run_id)
    # 0 completed rounds lost: every row of rounds 1-2 is still there, unchanged.
    for key in ("rounds", "versions"):
        assert set(before[key]) <= set(after[key]), key  # type: ignore[arg-type]
    assert set(before["metrics"]) <= set(after["metrics"])  # type: ignore[arg-type]
    rounds = repo.list_rounds(run_id)
    assert sorted(r.number for r in rounds if r.status == RoundStatus.COMPLETED) == [1, 2, 3, 4]
    [aborted] = [r for r in rounds if r.status == RoundStatus.ABORTED]
    assert aborted.number == 3 and "interrupted" in (aborted.error or "")
    redo = next(r for r in rounds if r.number == 3 and r.status == RoundStatus.COMPLETED)
    assert redo.attempt == aborted.attempt + 1
    versions = repo.list_model_versions(run_id=run_id)
    assert [v.round for v in versions] == [1, 2, 3, 4]
    # the lineage continues from round 2's model, not from scratch
    assert versions[2].parent_id == versions[1].id
