"""How fast the admin's commands answer: wall time of fresh `quorumfl` processes.

Each command runs ``--repeats`` times as its own process (what an admin or a script pays each
time), interleaved, against a state DB of 25 recorded runs of 12 rounds each (made in a temporary
folder with the repository's own records). Reported: the median and the fastest wall time of
``quorumfl --help``, ``runs list``, ``runs list --format json`` and ``runs show``, and the largest peak
RSS of those processes. The issue's key is ``runs_list_median_s``.

    python benchmarks/cli_start.py            # 15 repeats
    python benchmarks/cli_start.py --smoke    # once each, for CI
    python benchmarks/cli_start.py --json     # last line: one JSON object
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _cli import parser as make_parser
from _cli import report

COMMANDS = {
    "help": ["--help"],
    "runs_list": ["runs", "list"],
    "runs_list_json": ["runs", "list", "--format", "json"],
    "runs_show": ["runs", "show", "25"],
}


def _seed(url: str) -> None:
    """25 runs of 12 completed rounds, each with its metrics, as a federation records them."""
    from quorumfl.server.state.database import connect
    from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus

    repo = Repository(connect(url, migrate=True))
    for i in range(25):
        run = repo.create_run(flower_run_id=2**40 + i, config={"secure-aggregation": "masking", "task": "image",
                                                               "dataset": "digits", "model": "mlp"},
                              strategy="fedprox", num_rounds=12)
        for number in range(1, 13):
            rnd = repo.start_round(run.id, number, [1, 2, 3, 4])
            repo.finish_round(rnd.id, RoundStatus.COMPLETED, participants=[1, 2, 3, 4], timings={"train": 3.0})
            repo.add_metrics(run.id, number, {"accuracy": 0.5 + number / 40, "loss": 1.0 / number})
        repo.finish_run(run.id, RunStatus.COMPLETED)


def main() -> None:
    parser = make_parser(__doc__ or "")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    repeats = 1 if args.smoke else args.repeats
    with tempfile.TemporaryDirectory(prefix="quorumfl-bench-cli-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'state.db'}"
        _seed(url)
        env = {**os.environ, "COLUMNS": "100"}
        times: dict[str, list[float]] = {name: [] for name in COMMANDS}
        for _ in range(repeats):
            for name, argv in COMMANDS.items():
                began = time.perf_counter()
                subprocess.run([sys.executable, "-m", "quorumfl.cli", "--db", url, *argv], check=True,
                               stdout=subprocess.DEVNULL, env=env)
                times[name].append(time.perf_counter() - began)
    figures: dict[str, float | int] = {"repeats": repeats}
    for name, values in times.items():
        figures[f"{name}_median_s"] = statistics.median(values)
        figures[f"{name}_min_s"] = min(values)
    figures["command_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    report(figures, as_json=args.json)


if __name__ == "__main__":
    main()
