"""Host slots: of many ClientApp processes on one host, at most K hold a slot at once, and a slot of a
process killed with SIGKILL is free again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quorumfl.aggregation.errors import ConfigError
from quorumfl.client.host_slots import SLOTS_DIR_ENV, SLOTS_ENV, hold_host_slot

HOLDER = """
import sys, time
from quorumfl.client.host_slots import hold_host_slot
slot = hold_host_slot()
start = time.time()
time.sleep(float(sys.argv[2]))
with open(sys.argv[1], "a") as f:
    f.write(f"{slot} {start} {time.time()}\\n")
"""


def _spawn(tmp_path: Path, log: Path, hold: float, slots: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, SLOTS_ENV: str(slots), SLOTS_DIR_ENV: str(tmp_path / "slots")}
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(log), str(hold)], env=env)


def test_at_most_k_processes_hold_a_slot_at_once(tmp_path: Path) -> None:
    log = tmp_path / "held.log"
    procs = [_spawn(tmp_path, log, 0.4, 2) for _ in range(6)]
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    spans = [(float(a), float(b)) for _, a, b in (line.split() for line in log.read_text().splitlines())]
    assert len(spans) == 6
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak == 2


def test_a_killed_holder_frees_its_slot(tmp_path: Path) -> None:
    log = tmp_path / "held.log"
    stuck = _spawn(tmp_path, log, 600, 1)
    time.sleep(1.5)  # it holds the only slot
    stuck.send_signal(signal.SIGKILL)
    stuck.wait(timeout=10)
    assert _spawn(tmp_path, log, 0.0, 1).wait(timeout=30) == 0
    assert len(log.read_text().splitlines()) == 1


def test_no_limit_and_bad_values() -> None:
    assert hold_host_slot({}) is None
    with pytest.raises(ConfigError, match=SLOTS_ENV):
        hold_host_slot({SLOTS_ENV: "two"})
    with pytest.raises(ConfigError, match=SLOTS_ENV):
        hold_host_slot({SLOTS_ENV: "0"})
