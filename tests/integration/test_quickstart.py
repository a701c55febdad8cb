"""The README's quickstart, run as written: command 1's `quorumfl demo` with its defaults, then every
command of the quickstart's first block, each in a fresh process on the demo's state. The commands
are read from the README, so the front page cannot drift from what works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def quickstart_commands() -> list[list[str]]:
    """The quickstart block's commands (comments dropped), as argv after `quorumfl`."""
    section = README.read_text().split("## Five minutes: the quickstart", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("  #")[0].split() for line in block.splitlines() if line.strip()]
    assert lines and all(words[0] == ".venv/bin/quorumfl" for words in lines), lines
    return [words[1:] for words in lines]


def demo_command() -> list[str]:
    """README command 1's demo, as argv after `quorumfl`."""
    first = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    (line,) = [line for line in first.splitlines() if line.startswith("./setup.sh && ")]
    words = line.removeprefix("./setup.sh && ").split()
    assert words[0] == ".venv/bin/quorumfl"
    return words[1:]


def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    env = {**os.environ, "QUORUMFL_HOME": str(tmp_path / "home")}
    env.pop("QUORUMFL_DB_URL", None)

    def quorumfl(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([sys.executable, "-m", "quorumfl.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=timeout, check=False)
        assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
        return done

    assert demo_command() == ["demo"]
    quorumfl(demo_command(), timeout=600)
    outputs = {" ".join(args): quorumfl(args, timeout=120).stdout for args in quickstart_commands()}
    assert set(outputs) == {"runs list", "runs show 1", "rounds list 1", "models list"}
    assert "completed" in outputs["runs list"] and "masked" in outputs["runs list"]
    assert "alone" in outputs["runs show 1"]  # the federation vs each department alone
    assert outputs["rounds list 1"].count("completed") == 5  # the default five rounds
