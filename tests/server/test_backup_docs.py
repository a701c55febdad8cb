"""The backup and restore how-to (docs/how-to/backups.md), SQLite case, run as written: its shell
lines (with the home and the backup folder made the test's own) back up a state DB with a run and a
stored model, the home is lost, and the restore lines bring back what `runs list` and `models show`
read, the model file checked against its SHA-256."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "backups.md"


def blocks(title: str) -> list[str]:
    """The commands of the first bash block after the heading ``title`` (comments dropped)."""
    section = PAGE.read_text().split(f"## {title}\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.skipif(shutil.which("sqlite3") is None or shutil.which("tar") is None, reason="needs sqlite3 and tar")
def test_the_sqlite_backup_and_restore_run_as_written(tmp_path: Path) -> None:
    home, backup = tmp_path / "home" / ".quorumfl", tmp_path / "backup"
    backup.mkdir()
    (home / "certs").mkdir(parents=True)
    (home / "certs" / "ca.crt").write_text("the federation CA\n")
    repo = Repository(connect(f"sqlite:///{home / 'quorumfl.db'}", migrate=True))
    run = repo.create_run(flower_run_id=7, config={"dataset": "digits", "model": "mlp"}, strategy="fedavg",
                          num_rounds=1)
    stored = ModelStore(home / "models").save({"w": np.arange(6, dtype=np.float32)}, "run1-round0001")
    version = repo.add_model_version(run_id=run.id, round_number=1, parent_id=None, architecture="mlp",
                                     path=str(stored.path), sha256=stored.sha256, size_bytes=stored.size_bytes,
                                     metrics={"accuracy": 0.5})
    env = {**os.environ, "HOME": str(tmp_path / "home"), "QUORUMFL_HOME": str(home)}
    env.pop("QUORUMFL_DB_URL", None)

    def shell(line: str) -> str:
        line = line.replace("/backup", str(backup)).replace("VERSION", str(version.id))
        if line.startswith("quorumfl "):
            line = f"{sys.executable} -m quorumfl.cli {line.removeprefix('quorumfl ')}"
        done = subprocess.run(line, shell=True, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, (line, done.stdout, done.stderr)
        return done.stdout

    for line in blocks("The server"):
        if not line.startswith("pg_dump"):  # the PostgreSQL line has its own server
            shell(line)
    shutil.rmtree(home)  # the machine is lost
    outputs = [shell(line) for line in blocks("Restore") if not line.startswith("pg_restore")]
    runs_list, models_show = outputs[-2], outputs[-1]
    assert "│ 1  │ running │" in runs_list  # the run as it was at the backup
    assert stored.sha256 in models_show and "file_ok: True" in models_show
    assert (home / "certs" / "ca.crt").read_text() == "the federation CA\n"
