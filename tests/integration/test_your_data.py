"""The docs' "Your department's data" (docs/tutorials/your-data.md), run as written: real processes, three departments with a CSV
of their own, TLS and node authentication, masking; a tabular (regression) and a text federation.

The commands are read from the page's bash block, so the section cannot drift from what works:
the department lines run once per department (with its name), the port becomes a free one, and the
text run makes the substitutions the page's sentence after the block names.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from quorumfl.core.data import read_partition
from quorumfl.deploy.processes import ProcessGroup, free_port, wait_for_port
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RunStatus
from tests.core.city_data import TOPICS, ZONES, property_rows, request_rows, write_csv

PAGE = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "your-data.md"
DEPARTMENTS = ["tax-office", "urban-planning", "housing"]
LONG_RUNNING = ("server start", "node start")


def page_commands() -> list[str]:
    section = PAGE.read_text().split("# Your department's data", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", "")
    return [" ".join(line.split("  #")[0].split()) for line in block.splitlines() if line.startswith("quorumfl ")]


def _run_section(tmp_path: Path, commands: list[str]) -> tuple[subprocess.CompletedProcess[str], Repository]:
    """The admin's set-up lines, each department's lines (with its name), then the admin's run."""
    env = {**os.environ, "QUORUMFL_HOME": str(tmp_path / "home")}
    port = str(free_port())
    mine = [i for i, c in enumerate(commands) if "tax-office" in c and "certs init" not in c]
    setup, department, train = commands[: mine[0]], commands[mine[0] : mine[-1] + 1], commands[mine[-1] + 1 :]
    logs = tmp_path / "logs"

    def run(group: ProcessGroup, line: str, *extra: str) -> subprocess.CompletedProcess[str]:
        words = line.replace("9093", port).split()
        assert words[0] == "quorumfl"
        argv = [sys.executable, "-m", "quorumfl.cli", *words[1:], *extra]
        if any(k in line for k in LONG_RUNNING):
            child = group.start(str(len(group.children)), argv, cwd=tmp_path)
            if "server start" in line:
                wait_for_port("127.0.0.1", int(port), timeout=90, process=child.process)
            return subprocess.CompletedProcess(argv, 0, "", "")
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=500, check=False)
        if "runs start" not in line:
            assert done.returncode == 0, (line, done.stdout, done.stderr)
        return done

    # The servers and nodes run in a group of their own: leaving it stops each one's whole process tree
    # (SuperLink, SuperNodes, SuperExecs), also where the test runner ignores SIGINT (a CI run in the
    # background), which a Ctrl-C sent to `server start` alone would not reach.
    with ProcessGroup(logs, env) as group:
        for line in setup:
            run(group, line)
        for name in DEPARTMENTS:
            for line in department:
                run(group, line.replace("tax-office", name))
        [admin] = train
        final = run(group, admin, "--timeout", "400")
        assert final.returncode == 0, final.stdout + final.stderr + "".join(
            p.read_text(errors="replace")[-3000:] for p in sorted(logs.iterdir()))
    repo = Repository(connect(f"sqlite:///{tmp_path / 'home' / 'quorumfl.db'}", migrate=False))
    return final, repo


def _department_rows(output: str, metric: str) -> dict[str, float]:
    rows = {}
    for department in DEPARTMENTS:
        match = re.search(rf"{department}\s+│?\s*([0-9.e+-]+)", output)
        assert match, f"no {metric} row for {department} in:\n{output}"
        rows[department] = float(match.group(1))
    return rows


@pytest.mark.slow
def test_a_tabular_federation_from_the_departments_own_csv_files(tmp_path: Path) -> None:
    columns = ["parcel", "area", "year_built", "zone", "sale_price"]
    write_csv(tmp_path / "sales-sample.csv", property_rows(40, seed=99), columns=columns)
    for i, department in enumerate(DEPARTMENTS):
        write_csv(tmp_path / f"{department}-sales.csv", property_rows(150, seed=i, zone_bias=ZONES[i]), columns=columns)

    final, repo = _run_section(tmp_path, page_commands())

    assert "mae" in final.stdout and "completed" in final.stdout, final.stdout
    [run] = repo.list_runs()
    assert run.status == RunStatus.COMPLETED and run.config["secure-aggregation"] == "masking"
    finals = {m.node_id: m.value for m in repo.metrics(run.id, name="final-mae")}
    assert len(finals) == 3 and all(0 < v < 200_000 for v in finals.values())  # dollars, on a ~$500k scale
    shown = _department_rows(final.stdout, "mae")
    assert sorted(round(v) for v in shown.values()) == sorted(round(v) for v in finals.values())
    # Round 1 was the statistics round, masked: the model's standardisation is the three departments'
    # example-weighted mean (numpy, from their partition files).
    first = next(v for v in repo.list_model_versions(run_id=run.id) if v.round == 1)
    stored = ModelStore.load(first.path, first.sha256)
    xs = np.concatenate([read_partition(tmp_path / f"{d}-data").train.x.astype(np.float64) for d in DEPARTMENTS])
    np.testing.assert_allclose(stored["0.mean"], xs.mean(axis=0), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_text_federation_from_the_departments_own_csv_files(tmp_path: Path) -> None:
    topics = list(TOPICS)
    write_csv(tmp_path / "sales-sample.csv", request_rows(60, seed=99))
    for i, department in enumerate(DEPARTMENTS):
        write_csv(tmp_path / f"{department}-sales.csv", request_rows(150, seed=i, topic_bias=topics[i]))
    commands = [c.replace("--task tabular --label sale_price --ignore parcel", "--task text --text request --label "
                          "office --ignore id").replace("-c task=tabular", "-c task=text -c model=fasttext")
                for c in page_commands()]

    final, repo = _run_section(tmp_path, commands)

    [run] = repo.list_runs()
    assert run.status == RunStatus.COMPLETED and run.config["task"] == "text"
    finals = {m.node_id: m.value for m in repo.metrics(run.id, name="final-accuracy")}
    assert len(finals) == 3 and all(v > 0.6 for v in finals.values()), finals  # 3 offices: chance is 1/3
    assert set(_department_rows(final.stdout, "accuracy")) == set(DEPARTMENTS)

