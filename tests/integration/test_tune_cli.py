"""``quorumfl tune`` as an admin uses it: a search on Flower's simulation engine from a config file, its
trials in the state DB, the best run config written and runnable, and bad input refused with one
line, a documented exit code and nothing run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from quorumfl.server.config import RunConfig

SEARCH = """
[run]
num-rounds = 2
secure-aggregation = "masking"
min-nodes = 3
{extra}
[search]
learning-rate = {{ low = 0.01, high = 0.2, log = true }}
local-epochs = [1, 2]
"""


def _quorumfl(home: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    ray_tmp = tempfile.mkdtemp(prefix="qt-", dir="/tmp")  # short: Ray's sockets go below it
    try:
        return subprocess.run([sys.executable, "-m", "quorumfl.cli", "--home", str(home), *args], capture_output=True,
                              text=True, timeout=600, check=False, cwd=cwd,
                              env={**os.environ, "RAY_TMPDIR": ray_tmp, "COLUMNS": "200"})
    finally:
        subprocess.run(["rm", "-rf", ray_tmp], check=False)


def test_bad_searches_are_refused_with_one_line_and_run_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    bad = tmp_path / "bad.toml"
    bad.write_text(SEARCH.format(extra="") + "dp-epsilon = { low = 1.0, high = 8.0 }\n")
    done = _quorumfl(home, "tune", "run", str(bad), "--trials", "2")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "[search] dp-epsilon: cannot be searched" in done.stderr and len(done.stderr.strip().splitlines()) <= 3

    # DP: 4 trials of ε 3 = 12 past a budget of 10, refused before any trial (exit 13)
    greedy = tmp_path / "greedy.toml"
    greedy.write_text(SEARCH.format(extra='dp = "local"\ndp-epsilon = 3.0\n'))
    done = _quorumfl(home, "tune", "run", str(greedy), "--trials", "4", "--departments", "3")
    assert done.returncode == 13, done.stdout + done.stderr
    assert "up to ε = 12" in done.stderr and "run fewer trials or lower dp-epsilon" in done.stderr
    listed = _quorumfl(home, "runs", "list", "--format", "json")  # nothing was made, not even the state DB
    assert listed.returncode == 6 and "no state database" in listed.stderr, listed.stdout + listed.stderr
    assert not (home / "tuning").exists()

    assert _quorumfl(home, "db", "upgrade").returncode == 0
    done = _quorumfl(home, "tune", "show", "nope")
    assert done.returncode == 5 and "no search named 'nope'" in done.stderr


@pytest.mark.slow
def test_a_search_on_the_simulation_engine_records_its_trials_and_writes_the_best_config(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = tmp_path / "digits.toml"
    config.write_text(SEARCH.format(extra=""))
    done = _quorumfl(home, "tune", "run", str(config), "--trials", "2", "--departments", "3", "--cpus", "2",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trial 0:" in done.stderr and "trial 1:" in done.stderr

    view = json.loads(_quorumfl(home, "tune", "show", "digits", "--format", "json").stdout)
    runs = {r["id"]: r for r in json.loads(_quorumfl(home, "runs", "list", "--format", "json").stdout)}
    assert [t["trial"] for t in view["trials"]] == [0, 1] and set(runs) == {t["run"] for t in view["trials"]}
    for trial in view["trials"]:
        assert runs[trial["run"]]["privacy_label"] == "masked"
        if trial["state"] == "complete":
            assert trial["value"] == pytest.approx(runs[trial["run"]]["final_metric"])
    best = view["best"]
    assert best is not None and best["value"] == max(t["value"] for t in view["trials"] if t["value"] is not None)

    written = tomllib.loads((tmp_path / "best-digits.toml").read_text())["run"]
    assert written["learning-rate"] == best["params"]["learning-rate"] and written["secure-aggregation"] == "masking"
    RunConfig.from_mapping(written)  # a run config 'runs start' takes
    assert "state-url" not in written

    report = _quorumfl(home, "tune", "report", "digits", "--out", str(tmp_path / "reports"))
    assert report.returncode == 0, report.stderr
    assert "<img" in (tmp_path / "reports" / "search-digits.html").read_text()
