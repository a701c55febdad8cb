"""Load: one federation of many SuperNodes on this machine (default 50) completes FedAvg rounds.

Every department is a real ``flower-supernode`` process with its own registered key, talking TLS to
one SuperLink (the product's defaults); each training request starts a ClientApp process, as Flower
does. Reported: time until every node is online, the round's wall time and phases, and memory: the
peak of the summed RSS of every process of the federation (sampled every 0.5 s), the machine's peak
used memory, the SuperLink's peak and the ServerApp's own peak (recorded by the round).

    python benchmarks/load.py [--nodes 50] [--rounds 1] [--smoke] [--json]

``--slots K`` (default 2, the cores here): the nodes share the host as department nodes on one
server would (``quorumfl node start --host-slots``), so at most K ClientApps run at once; the others
wait in the launch gate before Flower's ``flwr-clientapp`` starts (``deploy/launch_gate.py``).
``--nice N`` (default 19) runs the SuperNodes and their ClientApps at a lower CPU priority than the
SuperLink and the ServerApp. ``--task-poll S`` (default 1.0, Flower's own default; local federations
use 0.25 for short round trips): how often each node's SuperExec asks for work; 50 nodes asking 4
times a second is a load of its own.

JSON keys: nodes, slots, tls, nice, task_poll_s, rounds_completed, participants, failures, connect_s, run_s, round_s, train_s,
federation_peak_rss_mb, machine_used_peak_mb, superlink_peak_rss_mb, serverapp_peak_rss_mb.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from _cli import parser, report
from _common import round_seconds
from quorumfl.core.data import prepare_partitions
from quorumfl.deploy.local import local_federation
from quorumfl.deploy.processes import _descendants, terminate_on_signals
from quorumfl.server.services import follow_run
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RoundStatus


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return 0.0


def _machine_used_mb() -> float:
    info = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
    return (info["MemTotal"] - info["MemAvailable"]) / 1024.0


class MemorySampler(threading.Thread):
    """Peaks of the summed RSS below ``roots`` and of the machine's used memory, every ``every`` s."""

    def __init__(self, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.every = every
        self.roots: set[int] = set()
        self.link: int | None = None
        self.federation_peak = 0.0
        self.link_peak = 0.0
        self.baseline = _machine_used_mb()
        self.machine_peak = 0.0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every):
            pids = self.roots | _descendants(self.roots)
            self.federation_peak = max(self.federation_peak, sum(_rss_mb(p) for p in pids))
            if self.link is not None:
                self.link_peak = max(self.link_peak, _rss_mb(self.link))
            self.machine_peak = max(self.machine_peak, _machine_used_mb())

    def stop(self) -> None:
        self._done.set()
        self.join()


def main() -> None:
    args_parser = parser(__doc__ or "")
    args_parser.add_argument("--nodes", type=int, default=50)
    args_parser.add_argument("--rounds", type=int, default=1)
    args_parser.add_argument("--slots", type=int, default=2, help="ClientApps training at once on this host (0: all)")
    args_parser.add_argument("--insecure", action="store_true", help="no TLS and no node authentication")
    args_parser.add_argument("--nice", type=int, default=19, help="CPU niceness of the SuperNodes and their ClientApps")
    args_parser.add_argument("--task-poll", type=float, default=1.0, help="seconds between a SuperExec's task polls")
    args = args_parser.parse_args()
    os.environ["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(args.task_poll)  # read by flower_env
    nodes, rounds = (5, 1) if args.smoke else (args.nodes, args.rounds)
    sampler = MemorySampler()
    sampler.start()
    with tempfile.TemporaryDirectory(prefix="quorumfl-load-") as tmp:
        home = Path(tmp)
        db_url = f"sqlite:///{home / 'state.db'}"
        repo = Repository(connect(db_url, migrate=True))
        names = [f"dept-{i:03d}" for i in range(nodes)]
        parts = prepare_partitions(home / "data", names, method="iid", seed=0)
        started = time.monotonic()
        with local_federation(home, parts, db_url=db_url, connect_timeout=900.0,
                              clientapp_slots=args.slots, node_nice=args.nice, tls=not args.insecure) as federation:
            connect_s = time.monotonic() - started
            sampler.link = federation.link.process.pid
            sampler.roots = {c.process.pid for c in federation.group.children}
            run_started = time.monotonic()
            flower_run_id = federation.control.start_run({
                "strategy": "fedavg", "model": "mlp", "num-rounds": rounds, "local-epochs": 1, "batch-size": 16,
                "start-from": "fresh", "min-nodes": nodes, "state-url": db_url, "model-dir": str(home / "models"),
                "round-timeout": 1800.0, "node-wait-timeout": 600.0, "secure-aggregation": "none",
            })
            try:
                run = follow_run(repo, flower_run_id, timeout=3600, alive=lambda: federation.alive(flower_run_id))
            except BaseException:  # the throw-away home goes with the federation: keep its logs to read
                kept = Path(tempfile.gettempdir()) / "quorumfl-load-logs"
                shutil.copytree(home / "logs", kept, dirs_exist_ok=True)
                print(f"load.py: the federation's logs are in {kept}", file=sys.stderr)
                raise
            run_s = time.monotonic() - run_started
            logs = federation.logs(40)
        sampler.stop()
        done = [r for r in run.rounds if r.status == RoundStatus.COMPLETED]
        if run.status != "completed" or len(done) != rounds:
            raise SystemExit(f"run ended {run.status}: {run.error}; rounds "
                             f"{[(r.number, r.status, r.error) for r in run.rounds]}\n{logs}")
        server_rss = max(m.value for m in repo.metrics(run.id, name="server-peak-rss-mb"))
        figures = {
            "nodes": nodes,
            "slots": args.slots,
            "tls": not args.insecure,
            "nice": args.nice,
            "task_poll_s": args.task_poll,
            "rounds_completed": len(done),
            "participants": min(len(r.participants) for r in done),
            "failures": sum(len(r.failures) for r in run.rounds),
            "connect_s": round(connect_s, 1),
            "run_s": round(run_s, 1),
            "round_s": round(max(round_seconds(r.timings) for r in done), 1),
            "train_s": round(max(r.timings.get("train", 0.0) for r in done), 1),
            "federation_peak_rss_mb": round(sampler.federation_peak, 0),
            "machine_used_peak_mb": round(sampler.machine_peak - sampler.baseline, 0),
            "superlink_peak_rss_mb": round(sampler.link_peak, 0),
            "serverapp_peak_rss_mb": round(server_rss, 0),
        }
    report(figures, as_json=args.json)


if __name__ == "__main__":
    with terminate_on_signals():  # SIGTERM unwinds too, so every node process is stopped
        main()
