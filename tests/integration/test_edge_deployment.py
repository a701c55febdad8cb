"""Edge sync end to end with the CLI alone: `edge serve`, two devices running `edge sync --every`,
and `models promote --edge` publishing a new artifact that both devices pick up, verify and swap in;
between the two promotions the admin rotates the signing key (`edge keys rotate`), and the devices,
still started with the first public key, follow the served chain to the new one, and fetch v2 as a
delta against the v1 they hold."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from quorumfl.deploy.processes import free_port, wait_for_port
from quorumfl.edge.sync import installed
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

from ..edge.conftest import store_version, train_digits_mlp


def _cli(home: Path | None, *args: str) -> list[str]:
    root = ["--home", str(home)] if home is not None else []
    return [sys.executable, "-m", "quorumfl.cli", *root, *args]


def _wait_for(predicate: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what()}")


def _version(device: Path) -> int | None:
    try:
        state = installed(device)
    except Exception:  # the file may be mid-replace; atomic rename makes this rare
        return None
    return state.current.manifest.version if state.current else None


@pytest.mark.slow
def test_server_and_two_devices_sync_a_newly_promoted_artifact(tmp_path: Path) -> None:
    # Prepare: a state DB holding one digits model version, the sync server, two devices syncing every second
    home = tmp_path / "home"
    repo = Repository(connect(f"sqlite:///{home / 'quorumfl.db'}", migrate=True))
    model, _ = train_digits_mlp(epochs=5)
    version_id = store_version(repo, home, model)
    init = subprocess.run(_cli(home, "edge", "keys", "init"), capture_output=True, text=True, timeout=120, check=False)
    assert init.returncode == 0, init.stderr
    public_key = tmp_path / "edge-public.pem"  # the devices' own copy, as provisioned (the server's file is rotated)
    public_key.write_bytes((home / "edge" / "signing-key.pub.pem").read_bytes())
    port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, args: list[str]) -> None:
        with open(logs / f"{name}.log", "wb") as log:
            started.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT))

    devices = [tmp_path / "device-a", tmp_path / "device-b"]
    try:
        start("server", _cli(home, "edge", "serve", "--port", str(port)))
        wait_for_port("127.0.0.1", port, timeout=90)
        for device in devices:
            start(device.name, _cli(None, "edge", "sync", "--server", f"127.0.0.1:{port}", "--dir", str(device),
                                    "--public-key", str(public_key), "--channel", "stable", "--every", "1"))

        # Execute: promote twice while the devices keep syncing, rotating the signing key in between
        for expected in (1, 2):
            if expected == 2:
                rotated = subprocess.run(_cli(home, "edge", "keys", "rotate"), capture_output=True, text=True,
                                         timeout=120, check=False)
                assert rotated.returncode == 0 and "signing key 1" in rotated.stdout, rotated.stdout + rotated.stderr
            promoted = subprocess.run(_cli(home, "models", "promote", str(version_id), "--edge", "--qat-epochs", "1"),
                                      capture_output=True, text=True, timeout=300, check=False)
            assert promoted.returncode == 0, promoted.stdout + promoted.stderr
            assert f"artifact v{expected} onnx" in promoted.stdout
            _wait_for(lambda v=expected: all(_version(d) == v for d in devices), 90,
                      lambda v=expected: f"both devices at v{v}: "
                      + ", ".join((logs / f"{d.name}.log").read_text()[-300:] for d in devices))

        # Assert: each device runs v2, kept v1 for rollback, and the registry lists both versions
        for device in devices:
            state = installed(device)
            assert state.previous is not None and state.previous.manifest.version == 1
            trust = json.loads((device / "trust.json").read_text())  # moved to key 1 through the served chain
            assert [json.loads(e["statement"])["sequence"] for e in trust["endorsements"]] == [1]
            predicted = subprocess.run(_cli(None, "edge", "predict", "--dir", str(device), "--public-key", str(public_key),
                                            "--samples", "64", "--format", "json"),
                                       capture_output=True, text=True, timeout=120, check=False)
            assert predicted.returncode == 0, predicted.stderr
            view = json.loads(predicted.stdout)
            assert view["version"] == 2 and view["samples"] == 64 and view["accuracy"] > 0.8
        listed = subprocess.run(_cli(home, "edge", "artifacts", "list", "--format", "json"), capture_output=True,
                                text=True, timeout=120, check=False)
        rows = json.loads(listed.stdout)
        assert sorted((r["version"], r["format"]) for r in rows) == [(1, "onnx"), (1, "pte"), (2, "onnx"), (2, "pte")]
        assert all(r["parent_model_version"] == version_id and r["channel"] == "stable" for r in rows)
        for device in devices:
            log = (logs / f"{device.name}.log").read_text()
            assert "installed v1" in log and "installed v2 (previous v1" in log
            assert re.search(r"installed v2 \(previous v1; \d+ bytes downloaded as a delta against v1\)", log), log
    finally:
        for proc in started:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in started:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
