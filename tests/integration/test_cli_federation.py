"""The admin workflow with the CLI alone: `certs init`, `server start`, `data split`, `node start`,
`runs start --follow`, with TLS and node authentication (the default); a node whose key the
federation did not issue is refused, and so is a revoked one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from quorumfl.deploy.processes import free_port, wait_for_port


def _cli(home: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "quorumfl.cli", "--home", str(home), *args]


@pytest.mark.slow  # a minute or more: the default suite stays under its 8 minutes
def test_server_nodes_and_run_from_the_cli(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = free_port()
    split = subprocess.run(
        _cli(home, "data", "split", "--out", str(tmp_path / "parts"), "--departments", "tax-office,parks", "--method", "iid"),
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert split.returncode == 0, split.stderr
    init = subprocess.run(_cli(home, "certs", "init", "--nodes", "tax-office,parks"), capture_output=True, text=True,
                          timeout=120, check=False)
    assert init.returncode == 0, init.stdout + init.stderr
    rogue = subprocess.run(_cli(tmp_path / "rogue", "certs", "init", "--nodes", "parks"), capture_output=True,
                           text=True, timeout=120, check=False)
    assert rogue.returncode == 0, rogue.stderr
    logs = tmp_path / "logs"
    logs.mkdir()
    started: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(_cli(home, *args), stdout=log, stderr=subprocess.STDOUT)
        started.append(proc)
        return proc

    try:
        metrics_port = free_port()
        server = start("server", "server", "start", "--port", str(port), "--metrics-port", str(metrics_port))
        wait_for_port("127.0.0.1", port, timeout=90)
        for dept in ("tax-office", "parks"):
            start(dept, "node", "start", "--department", dept, "--data", str(tmp_path / "parts" / dept),
                  "--superlink", f"127.0.0.1:{port}")
        # Before any run, `nodes list` already shows the departments whose keys the server registered.
        deadline = time.monotonic() + 60
        while True:
            listed_nodes = subprocess.run(_cli(home, "nodes", "list", "--format", "json"), capture_output=True,
                                          text=True, timeout=120, check=False)
            if listed_nodes.returncode == 0 and len(json.loads(listed_nodes.stdout)) == 2:
                break
            assert time.monotonic() < deadline, listed_nodes.stdout + listed_nodes.stderr
            time.sleep(1)
        assert {(n["department"], n["last_seen"]) for n in json.loads(listed_nodes.stdout)} == {
            ("tax-office", None), ("parks", None)}
        # A run config that names only num-rounds: private by default (masking), and every output says so.
        config = tmp_path / "run.toml"
        config.write_text("num-rounds = 1\n")
        run = subprocess.run(
            _cli(home, "runs", "start", str(config), "--superlink", f"127.0.0.1:{port}", "--follow", "--timeout", "300"),
            capture_output=True, text=True, timeout=400, check=False,
        )
        assert run.returncode == 0, run.stdout + run.stderr + (logs / "server.log").read_text()
        said = " ".join(run.stdout.split())
        assert "completed" in said and "masked: the server learns only sums of at least t = 60%" in said
        listed = subprocess.run(_cli(home, "runs", "list", "--format", "json"), capture_output=True, text=True, timeout=120, check=False)
        [record] = json.loads(listed.stdout)
        assert record["status"] == "completed" and record["rounds_completed"] == 1 and record["strategy"] == "fedavg"
        assert record["secure_aggregation"] == "masked" and record["dp"] == "none" and record["threshold"] == "60% of each round's nodes"
        assert "masked" in subprocess.run(_cli(home, "runs", "list"), capture_output=True, text=True, timeout=120,
                                          check=True).stdout
        shown = subprocess.run(_cli(home, "runs", "show", "1"), capture_output=True, text=True, timeout=120, check=True)
        assert "masked: the server learns only sums" in " ".join(shown.stdout.split())
        report = subprocess.run(_cli(home, "runs", "report", "1", "--out", str(tmp_path / "report")),
                                capture_output=True, text=True, timeout=120, check=True)
        page = (tmp_path / "report" / "run-1.html").read_text()
        assert "QuorumFL run 1: completed, masked," in page and "masked: the server learns only sums" in page, report.stdout
        nodes = json.loads(subprocess.run(_cli(home, "nodes", "list", "--format", "json"), capture_output=True, text=True,
                                          timeout=120, check=False).stdout)
        assert sorted(n["department"] for n in nodes) == ["parks", "tax-office"]
        # The server's Prometheus endpoint counts what the state DB holds.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for family in text_string_to_metric_families(response.read().decode()) for s in family.samples}
        assert samples[("quorumfl_rounds_total", (("status", "completed"),))] == 1
        assert samples[("quorumfl_runs", (("status", "completed"),))] == 1
        assert samples[("quorumfl_nodes", (("state", "known"),))] == 2
        assert samples[("quorumfl_nodes", (("state", "seen_5m"),))] == 2  # both connected during the run
        assert samples[("quorumfl_bytes_total", (("direction", "up"),))] > 0
        [info] = [labels for (name, labels) in samples if name == "quorumfl_last_run_info"]
        assert dict(info)["secure_aggregation"] == "masked" and dict(info)["dp"] == "none", info
        # A run that fails is an error for scripts: --follow exits with the code of the cause (7: the
        # model store), not 0.
        (tmp_path / "not-a-folder").write_text("")
        # Plaintext only when asked for, and then labelled so.
        failing = subprocess.run(
            _cli(home, "runs", "start", str(config), "--superlink", f"127.0.0.1:{port}", "--follow", "--timeout", "300",
                 "-c", "secure-aggregation='none'", "-c", "num-rounds=1", "-c", "local-epochs=1",
                 "-c", f"model-dir='{tmp_path / 'not-a-folder'}'"),
            capture_output=True, text=True, timeout=400, check=False,
        )
        assert failing.returncode == 7, failing.stdout + failing.stderr
        assert "failed: ModelStoreError: cannot write model file" in failing.stderr, failing.stderr
        assert "plaintext: the server sees each department's update" in " ".join(failing.stdout.split())
        second = json.loads(subprocess.run(_cli(home, "runs", "list", "--format", "json"), capture_output=True,
                                           text=True, timeout=120, check=True).stdout)[-1]
        assert second["secure_aggregation"] == "plaintext" and second["privacy_label"] == "plaintext"
        plain_report = json.loads(subprocess.run(_cli(home, "runs", "report", "2", "--format", "json"),
                                                 capture_output=True, text=True, timeout=120, check=True).stdout)
        assert plain_report["run"]["privacy"].startswith("plaintext")

        # A second node with a key that already runs on this machine is refused at once.
        twin = subprocess.run(
            _cli(home, "node", "start", "--department", "tax-office", "--data", str(tmp_path / "parts" / "tax-office"),
                 "--superlink", f"127.0.0.1:{port}"),
            capture_output=True, text=True, timeout=120, check=False)
        assert twin.returncode == 11, twin.stdout + twin.stderr
        assert "already runs on this machine (pid" in twin.stderr and "one key, one running node" in twin.stderr
        # A key the federation did not issue (same name, another CA's folder) is refused at the SuperLink:
        # at once by default (this key was never connected from here, so no crashed SuperNode of it can
        # still count as online), and after trying again for an explicit --rejoin-wait.
        began = time.monotonic()
        unknown = subprocess.run(
            _cli(home, "node", "start", "--department", "parks", "--data", str(tmp_path / "parts" / "parks"),
                 "--superlink", f"127.0.0.1:{port}", "--key", str(tmp_path / "rogue" / "certs" / "nodes" / "parks.key")),
            capture_output=True, text=True, timeout=120, check=False)
        assert unknown.returncode == 11, unknown.stdout + unknown.stderr
        assert "trying again" not in unknown.stdout and "kept trying" not in unknown.stderr, unknown.stdout
        assert "not registered there" in unknown.stderr and "revoked" in unknown.stderr, unknown.stderr
        assert time.monotonic() - began < 45  # not the ~90 s of retries it once took
        refused = subprocess.run(
            _cli(home, "node", "start", "--department", "parks", "--data", str(tmp_path / "parts" / "parks"),
                 "--superlink", f"127.0.0.1:{port}", "--key", str(tmp_path / "rogue" / "certs" / "nodes" / "parks.key"),
                 "--rejoin-wait", "5"),
            capture_output=True, text=True, timeout=120, check=False)
        assert refused.returncode == 11, refused.stdout + refused.stderr
        assert "trying again" in refused.stdout, refused.stdout
        assert "kept trying for 5 s" in refused.stderr and "not registered" in refused.stderr, refused.stderr
        # A CA from another federation: the node says so (exit 11, naming the file), not "exited with code 1".
        foreign_ca = subprocess.run(
            _cli(home, "node", "start", "--department", "parks", "--data", str(tmp_path / "parts" / "parks"),
                 "--superlink", f"127.0.0.1:{port}", "--ca-cert", str(tmp_path / "rogue" / "certs" / "ca.crt"),
                 "--key", str(tmp_path / "rogue" / "certs" / "nodes" / "parks.key")),  # parks' own key is in use
            capture_output=True, text=True, timeout=120, check=False)
        assert foreign_ca.returncode == 11, foreign_ca.stdout + foreign_ca.stderr
        assert f"did not verify against {tmp_path / 'rogue' / 'certs' / 'ca.crt'}" in foreign_ca.stderr, foreign_ca.stderr
        # Without TLS the SuperLink does not answer the Control API either.
        plain = subprocess.run(
            _cli(home, "runs", "start", str(config), "--superlink", f"127.0.0.1:{port}", "--insecure"),
            capture_output=True, text=True, timeout=120, check=False)
        assert plain.returncode == 8 and "warning: --insecure" in plain.stderr, plain.stdout + plain.stderr
        # Revoking a node's key cuts it off: its SuperNode leaves the federation.
        revoked = subprocess.run(_cli(home, "certs", "revoke", "parks", "--superlink", f"127.0.0.1:{port}"),
                                 capture_output=True, text=True, timeout=120, check=False)
        assert revoked.returncode == 0, revoked.stdout + revoked.stderr
        assert "unregistered retired key parks" in revoked.stdout
        assert "(parks) disabled in the state DB" in revoked.stdout, revoked.stdout
        nodes = json.loads(subprocess.run(_cli(home, "nodes", "list", "--format", "json"), capture_output=True, text=True,
                                          timeout=120, check=False).stdout)
        assert {n["department"]: n["enabled"] for n in nodes} == {"parks": False, "tax-office": True}
        # ...and the revoked node says so (exit 11), where it used to end with status 0 and no word.
        parks = started[2]
        parks.wait(timeout=60)
        assert parks.returncode == 11, (logs / "parks.log").read_text()
        assert "left the federation: the SuperLink dropped its key" in (logs / "parks.log").read_text()
    finally:
        for proc in started:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for proc in started:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
    assert server.returncode == 130  # stopped by the signal, after stopping its SuperLink
