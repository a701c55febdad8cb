"""The docs' "Deploying across machines" (docs/how-to/deploy.md), run as written on hosts of the test's own: the server
and two departments each in a network namespace (separate addresses, joined by virtual Ethernet
links to the server), ``fl.city.example`` in each namespace's hosts file, a home directory per
machine. The server's block sets up the federation and copies each department's files (``ssh`` and
``scp`` become a directory and file copies into that department's home); each department's block
starts its node; the admin's block runs a masked federation and lists the nodes.

What crosses the network is checked on the way: a node that dials the server's raw address (not in
its certificate) stops with the certificate refusal; the parks department starts while its firewall
blocks the server's port (an ``ip rule … prohibit`` for TCP to that port), warns that the server does
not answer, and connects by itself once the rule is lifted.

Needs root and iproute2 (``ip netns``); skipped with the reason where the machine has neither.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from quorumfl.deploy.processes import Child, ProcessGroup

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "deploy.md"
SERVER_NAME = "fl.city.example"
PORT = 9093
DEPARTMENTS = {"tax-office": 1, "parks": 2}  # department → subnet 10.88.<n>.0/24 to the server


def page_blocks() -> list[list[str]]:
    """The section's three bash blocks (server, department, admin), one command per line."""
    section = PAGE.read_text().split("# Deploying across machines", 1)[1].split("\n## ", 1)[0]
    blocks = [part.split("```", 1)[0] for part in section.split("```bash\n")[1:]]
    return [[line.split("  #")[0].strip() for line in block.replace("\\\n", "").splitlines() if line.strip()]
            for block in blocks]


@dataclass
class Host:
    namespace: str
    home: Path  # $HOME on this machine; QuorumFL's home is ~/.quorumfl

    def argv(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, "env", f"HOME={self.home}", *args]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[dict[str, Host]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    tag = f"qfl{os.getpid()}"
    made: list[str] = []
    try:
        server = Host(f"{tag}-server", tmp_path / "server")
        try:
            _ip("netns", "add", server.namespace)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"ip netns add failed here: {exc.stderr.decode().strip()}")
        made.append(server.namespace)
        machines = {"server": server}
        for department, subnet in DEPARTMENTS.items():
            host = Host(f"{tag}-{department}", tmp_path / department)
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
            link = f"to-{department}"[:15]
            _ip("-n", server.namespace, "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
            _ip("-n", server.namespace, "addr", "add", f"10.88.{subnet}.1/24", "dev", link)
            _ip("-n", host.namespace, "addr", "add", f"10.88.{subnet}.2/24", "dev", "eth0")
            _ip("-n", server.namespace, "link", "set", link, "up")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            machines[department] = host
        for name, host in machines.items():
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            host.home.mkdir()
            # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts: the server's name resolves
            # to the server's address on this host's link (on the server itself, its first one).
            address = f"10.88.{DEPARTMENTS.get(name, 1)}.1"
            (Path("/etc/netns") / host.namespace).mkdir(parents=True)
            (Path("/etc/netns") / host.namespace / "hosts").write_text(
                f"127.0.0.1 localhost\n{address} {SERVER_NAME}\n")
        yield machines
    finally:
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30, check=False)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)


def _quorumfl(line: str) -> list[str]:
    words = shlex.split(line)
    assert words[0] == "quorumfl", line
    return [sys.executable, "-m", "quorumfl.cli", *words[1:]]


def _run(host: Host, argv: list[str], *, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(host.argv(*argv), cwd=host.home, env=_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "QUORUMFL_HOME"}  # each machine's own ~/.quorumfl


def _copy(line: str, machines: dict[str, Host]) -> None:
    """``ssh DEPT.city.example mkdir -p DIR`` and ``scp SRC… DEPT.city.example:DIR/``, between homes."""
    words = shlex.split(line)
    if words[0] == "ssh":
        _, target, *command = words
        assert command[:2] == ["mkdir", "-p"], line
        (machines[target.removesuffix(".city.example")].home / command[2]).mkdir(parents=True, exist_ok=True)
        return
    *sources, destination = words[1:]
    target, _, folder = destination.partition(":")
    for source in sources:
        shutil.copy2(source.replace("~", str(machines["server"].home), 1),
                     machines[target.removesuffix(".city.example")].home / folder)


def _wait_for(child: Child, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in child.log.read_text(errors="replace"):
        assert child.process.poll() is None, child.log.read_text(errors="replace")
        assert time.monotonic() < deadline, f"no {text!r} in {child.log}:\n" + child.log.read_text(errors="replace")
        time.sleep(0.5)


@pytest.mark.slow
def test_the_deployment_guide_runs_as_written_across_machines(hosts: dict[str, Host], tmp_path: Path) -> None:
    server_block, department_block, admin_block = page_blocks()
    server = hosts["server"]
    split = subprocess.run([sys.executable, "-m", "quorumfl.cli", "--home", str(tmp_path / "scratch"), "data", "split",
                            "--out", str(tmp_path / "parts"), "--departments", ",".join(DEPARTMENTS), "--method", "iid"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert split.returncode == 0, split.stderr
    for department in DEPARTMENTS:  # each department's own partition, as `quorumfl data import` leaves it
        shutil.copytree(tmp_path / "parts" / department, hosts[department].home / f"{department}-data")

    with ProcessGroup(tmp_path / "logs", _env()) as group:
        for line in server_block:
            if line.startswith(("ssh ", "scp ")):
                for department in DEPARTMENTS:
                    _copy(line.replace("tax-office", department), hosts)
            elif "server start" in line:
                link = group.start("server", server.argv(*_quorumfl(line)), cwd=server.home)
                _wait_for(link, "SuperLink listening", timeout=90)
            else:
                done = _run(server, _quorumfl(line))
                assert done.returncode == 0, (line, done.stdout, done.stderr)
        assert not (hosts["tax-office"].home / ".quorumfl" / "certs" / "admin.key").exists()
        assert sorted(p.name for p in (hosts["parks"].home / ".quorumfl" / "certs" / "nodes").iterdir()) == ["parks.key"]

        [node_line] = department_block
        # The server's raw address is not a name in its certificate: the node stops, saying so.
        raw = _run(hosts["tax-office"], _quorumfl(node_line.replace(SERVER_NAME, "10.88.1.1")), timeout=120)
        assert raw.returncode != 0 and "did not verify" in raw.stderr, raw.stdout + raw.stderr

        tax = group.start("tax-office", hosts["tax-office"].argv(*_quorumfl(node_line)), cwd=hosts["tax-office"].home)
        _wait_for(tax, "node tax-office connected", timeout=120)

        blocked = ("ipproto", "tcp", "dport", str(PORT), "prohibit")
        _ip("-n", hosts["parks"].namespace, "rule", "add", *blocked)
        parks = group.start("parks", hosts["parks"].argv(*_quorumfl(node_line.replace("tax-office", "parks")),
                                                         "--warn-after", "3"), cwd=hosts["parks"].home)
        _wait_for(parks, "no answer from the SuperLink", timeout=60)
        assert "node parks connected" not in parks.log.read_text()
        _ip("-n", hosts["parks"].namespace, "rule", "del", *blocked)  # the firewall opens the port
        _wait_for(parks, "node parks connected", timeout=120)

        printf, start, listing = admin_block
        made = subprocess.run(server.argv("bash", "-c", printf), cwd=server.home, env=_env(), capture_output=True,
                              text=True, timeout=30, check=False)
        assert made.returncode == 0, made.stderr
        run = _run(server, [*_quorumfl(start), "--timeout", "400"], timeout=500)
        logs = "".join(c.log.read_text(errors="replace")[-3000:] for c in group.children)
        assert run.returncode == 0, run.stdout + run.stderr + logs
        assert "completed" in run.stdout, run.stdout
        nodes = _run(server, [*_quorumfl(listing), "--format", "json"])
        assert nodes.returncode == 0, nodes.stderr
        seen = {n["department"]: n["last_seen"] for n in json.loads(nodes.stdout)}
        assert set(seen) == set(DEPARTMENTS) and all(seen.values()), seen

    from quorumfl.server.state.database import connect
    from quorumfl.server.state.repository import Repository, RunStatus

    repo = Repository(connect(f"sqlite:///{server.home / '.quorumfl' / 'quorumfl.db'}", migrate=False))
    [record] = repo.list_runs()
    assert record.status == RunStatus.COMPLETED and record.config["secure-aggregation"] == "masking"
    assert len({m.node_id for m in repo.metrics(record.id, name="final-accuracy")}) == 2
