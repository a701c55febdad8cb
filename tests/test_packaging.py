"""`pip install .` (a real wheel, not the editable tree) yields a working quorumfl package:
the package-dir mapping, the Alembic migrations and the CLI entry point are all in it."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_and_migrates(tmp_path: Path) -> None:
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert install.returncode == 0, install.stderr
    # -S: no .pth files, so the editable install of the source tree cannot fill in what the wheel lacks
    script = (
        "import quorumfl.server, quorumfl.client.app, quorumfl.cli.main, quorumfl.server.app;"
        "import quorumfl.aggregation.secagg, quorumfl.aggregation.ckks;"
        "from quorumfl.server.state.database import connect;"
        f"connect('sqlite:///{tmp_path / 'w.db'}', migrate=True);"
        "print(quorumfl.server.__file__)"
    )
    check = subprocess.run(
        [sys.executable, "-S", "-c", script],
        env={"PYTHONPATH": f"{target}:{sysconfig.get_paths()['purelib']}", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip().startswith(str(target))  # the wheel's copy, not the source tree
    entry_points = next(target.glob("quorumfl-*.dist-info")) / "entry_points.txt"
    assert "quorumfl = quorumfl.cli.main:main" in entry_points.read_text()
