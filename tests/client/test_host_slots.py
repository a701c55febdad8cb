"""Host slots: of many ClientApp processes on one host, at most K hold a slot at once, and a slot of a
process killed with SIGKILL is free again; the launch gate takes the slot before Flower's
``flwr-clientapp`` starts, hands it over, and gives up within its wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quorumfl.core.slots import SLOTS_DIR_ENV, SLOTS_ENV, hold_host_slot
from quorumfl.deploy.host_slots import host_slot_env
from quorumfl.deploy.launch_gate import GATE_REAL_ENV, GATE_WAIT_ENV
from quorumfl.errors import ConfigError

HOLDER = """
import sys, time
from quorumfl.core.slots import hold_host_slot
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


# ---- the launch gate: Flower's flwr-clientapp starts only once the process holds a slot ----------

FAKE_CLIENTAPP = """#!{python}
import fcntl, os, sys, time
from pathlib import Path
from quorumfl.core.slots import hold_host_slot
slot = os.environ["QUORUMFL_CLIENTAPP_SLOT_HELD"]
fd = os.open(Path(os.environ["QUORUMFL_CLIENTAPP_SLOTS_DIR"]) / f"slot-{{slot}}", os.O_RDWR)
try:  # the slot the gate took is held by this process (inherited), so it cannot be taken again
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    sys.exit(3)
except BlockingIOError:
    pass
assert hold_host_slot() is None  # the ClientApp does not take a second slot
Path(sys.argv[1] + ".started").touch()
start = time.time()
time.sleep(float(sys.argv[2]))
with open(sys.argv[1], "a") as f:
    f.write(f"{{slot}} {{start}} {{time.time()}}\\n")
"""


def _gated(tmp_path: Path, slots: int) -> dict[str, str]:
    real = tmp_path / "flower-bin" / "flwr-clientapp"
    real.parent.mkdir(exist_ok=True)
    real.write_text(FAKE_CLIENTAPP.format(python=sys.executable))
    real.chmod(0o755)
    env = {**os.environ}
    env.update(host_slot_env(slots, tmp_path / "slots", path=env["PATH"], real_clientapp=real))
    return env


def _peak(spans: list[tuple[float, float]]) -> int:
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def test_gate_runs_the_real_clientapp_holding_a_slot_k_at_once(tmp_path: Path) -> None:
    env = _gated(tmp_path, 2)
    log = tmp_path / "held.log"
    # Found by name on PATH, as Flower's SuperExec starts it.
    procs = [subprocess.Popen(["flwr-clientapp", str(log), "1.0"], env=env) for _ in range(6)]
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    rows = [line.split() for line in log.read_text().splitlines()]
    assert len(rows) == 6 and {slot for slot, _, _ in rows} <= {"0", "1"}
    assert _peak([(float(a), float(b)) for _, a, b in rows]) == 2


def test_gate_gives_up_within_the_wait_before_flower_starts(tmp_path: Path) -> None:
    env = {**_gated(tmp_path, 1), GATE_WAIT_ENV: "1.5"}
    log = tmp_path / "held.log"
    holder = subprocess.Popen(["flwr-clientapp", str(log), "30"], env=env)
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{log}.started").exists():  # the holder runs, holding the only slot
            assert time.monotonic() < deadline and holder.poll() is None
            time.sleep(0.1)
        started = time.monotonic()
        late = subprocess.run(["flwr-clientapp", str(log), "0"], env=env, capture_output=True, text=True, timeout=90)
        waited = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert late.returncode == 75 and "no host slot free within 1.5 s" in late.stderr
    assert 1.4 < waited < 60 and not log.exists()  # the real ClientApp never ran


def test_gate_refuses_bad_settings(tmp_path: Path) -> None:
    env = _gated(tmp_path, 2)
    for key, value, named in ((SLOTS_ENV, "-1", SLOTS_ENV), (GATE_WAIT_ENV, "nan", GATE_WAIT_ENV),
                              (GATE_WAIT_ENV, "soon", GATE_WAIT_ENV),
                              (GATE_REAL_ENV, str(tmp_path / "missing"), GATE_REAL_ENV)):
        bad = subprocess.run(["flwr-clientapp"], env={**env, key: value}, capture_output=True, text=True, timeout=30)
        assert bad.returncode == 78 and named in bad.stderr, (key, bad.stderr)
    with pytest.raises(ConfigError, match="host slots"):
        host_slot_env(0, tmp_path / "slots", path="", real_clientapp=tmp_path / "x")
    with pytest.raises(ConfigError, match="flwr-clientapp-missing"):
        host_slot_env(2, tmp_path / "slots", path=str(tmp_path), real_clientapp=Path("flwr-clientapp-missing"))
