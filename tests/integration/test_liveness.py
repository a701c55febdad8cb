"""Nodes that are really there: a department stopped with Ctrl-C, and one whose `quorumfl node start`
was killed with SIGKILL, leave selection at once; a run started two seconds later selects neither
and completes every round under masking (the default); both started again at once rejoin under their
own ids and take part in the next run; nothing of the killed node's processes remains."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quorumfl.deploy.liveness import PARENT_ENV
from quorumfl.deploy.processes import free_port, wait_for_port

DEPARTMENTS = ("tax-office", "parks", "library", "housing")


def _cli(home: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "quorumfl.cli", "--home", str(home), *args]


def _carrying(marker: bytes) -> set[int]:
    """Live processes whose environment holds ``marker``."""
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0") and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def _wait_for(text: str, log: Path, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} not in {log}:\n{log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.2)


def _node_ids(home: Path) -> dict[str, str]:
    listed = subprocess.run(_cli(home, "nodes", "list", "--format", "json"), capture_output=True, text=True,
                            timeout=60, check=True).stdout
    return {str(n["department"]): str(n["node_id"]) for n in json.loads(listed)}


@pytest.mark.slow  # four nodes and two runs: a few minutes
@pytest.mark.timeout(900)
def test_stopped_and_killed_nodes_leave_selection_at_once_and_rejoin_at_once(tmp_path: Path) -> None:
    home, logs, port = tmp_path / "home", tmp_path / "logs", free_port()
    logs.mkdir()
    for step in (["data", "split", "--out", str(tmp_path / "parts"), "--departments", ",".join(DEPARTMENTS),
                  "--method", "iid"], ["certs", "init", "--nodes", ",".join(DEPARTMENTS)]):
        done = subprocess.run(_cli(home, *step), capture_output=True, text=True, timeout=180, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(_cli(home, *args), stdout=log, stderr=subprocess.STDOUT)
        started.append(proc)
        return proc

    def node(dept: str) -> subprocess.Popen[bytes]:
        size = (logs / f"{dept}.log").stat().st_size if (logs / f"{dept}.log").exists() else 0
        proc = start(dept, "node", "start", "--department", dept, "--data", str(tmp_path / "parts" / dept),
                     "--superlink", f"127.0.0.1:{port}", "--cold-clientapps")
        deadline = time.monotonic() + 90
        while f"node {dept} connected" not in (logs / f"{dept}.log").read_text(errors="replace")[size:]:
            assert proc.poll() is None and time.monotonic() < deadline, (logs / f"{dept}.log").read_text()[size:]
            time.sleep(0.2)
        return proc

    def run(rounds: int) -> list[dict[str, object]]:
        done = subprocess.run(
            _cli(home, "runs", "start", "--superlink", f"127.0.0.1:{port}", "--follow", "--timeout", "400",
                 "-c", f"num-rounds={rounds}", "-c", "local-epochs=1", "-c", "start-from='fresh'",
                 "-c", "node-wait-timeout=20"),
            capture_output=True, text=True, timeout=500, check=False)
        assert done.returncode == 0, done.stdout + done.stderr + (logs / "server.log").read_text()[-4000:]
        listed = json.loads(subprocess.run(_cli(home, "runs", "list", "--format", "json"), capture_output=True,
                                           text=True, timeout=60, check=True).stdout)
        assert listed[-1]["status"] == "completed" and listed[-1]["secure_aggregation"] == "masked"
        rounds_json = subprocess.run(_cli(home, "rounds", "list", str(listed[-1]["id"]), "--format", "json"),
                                     capture_output=True, text=True, timeout=60, check=True).stdout
        return list(json.loads(rounds_json))

    try:
        start("server", "server", "start", "--port", str(port))
        wait_for_port("127.0.0.1", port, timeout=90)
        nodes = {dept: node(dept) for dept in DEPARTMENTS}
        ids = _node_ids(home)
        assert sorted(ids) == sorted(DEPARTMENTS)
        stopped, killed = nodes["tax-office"], nodes["parks"]
        stopped.send_signal(signal.SIGINT)  # Ctrl-C
        killed.kill()  # SIGKILL of `quorumfl node start`: nothing can clean up in that process
        assert stopped.wait(timeout=60) == 130
        killed.wait(timeout=10)
        marker = f"{PARENT_ENV}={killed.pid}".encode()
        deadline = time.monotonic() + 15
        while left := _carrying(marker):
            assert time.monotonic() < deadline, f"processes of the killed node remain: {sorted(left)}"
            time.sleep(0.2)
        time.sleep(2.0)
        for rnd in run(1):
            assert rnd["status"] == "completed", rnd
            assert rnd["selected"] == 2 and sorted(rnd["participants"]) == ["housing", "library"], rnd  # type: ignore[arg-type]
        again = {dept: node(dept) for dept in ("tax-office", "parks")}  # at once: no "still online" refusal
        for dept in again:
            assert "trying again" not in (logs / f"{dept}.log").read_text(errors="replace")
        [last] = run(1)
        assert last["status"] == "completed" and sorted(last["participants"]) == sorted(DEPARTMENTS), last  # type: ignore[arg-type]
        assert _node_ids(home) == ids  # each department under its own node id, none added
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in started:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            for pid in _carrying(f"{PARENT_ENV}={proc.pid}".encode()):  # never leave a process behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # a server of its own
@pytest.mark.timeout(300)
def test_a_killed_server_start_takes_its_superlink_with_it(tmp_path: Path) -> None:
    home, port = tmp_path / "home", free_port()
    done = subprocess.run(_cli(home, "certs", "init", "--nodes", "tax-office"), capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen(_cli(home, "server", "start", "--port", str(port)), stdout=log,
                                  stderr=subprocess.STDOUT)
    marker = f"{PARENT_ENV}={server.pid}".encode()
    try:
        wait_for_port("127.0.0.1", port, timeout=90)
        assert _carrying(marker), "the SuperLink does not carry its starter's pid"
        server.kill()  # SIGKILL: `server start` cleans up nothing itself
        server.wait(timeout=10)
        deadline = time.monotonic() + 15
        while left := _carrying(marker):
            assert time.monotonic() < deadline, f"processes of the killed server remain: {sorted(left)}"
            time.sleep(0.2)
    finally:
        if server.poll() is None:
            server.kill()
        for pid in _carrying(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
