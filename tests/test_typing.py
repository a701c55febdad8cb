"""The product is mypy-strict clean. mypy cannot follow setuptools' package-dir mapping, so the
check runs on a tree of symlinks laid out as the installed ``quorumfl`` package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["server", "client", "aggregation", "privacy", "edge"]


def test_mypy_strict(tmp_path: Path) -> None:
    tree = tmp_path / "quorumfl"
    tree.mkdir()
    for name in PACKAGES:
        (tree / name).symlink_to(ROOT / name, target_is_directory=True)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "--no-incremental",
         "--cache-dir", str(tmp_path / "cache"), "-p", "quorumfl"],
        cwd=tmp_path, env={"MYPYPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
