"""The ``flower-superexec`` QuorumFL puts on Flower's PATH reaps the app processes Flower's executor
starts and drops (``subprocess.Popen(args)`` with no wait): none stays ``<defunct>``, a running child
is not touched, and code that does wait for its child still gets an answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from quorumfl.deploy.launch_gate import SUPEREXEC, write_superexec

# Starts apps the way Flower's SubprocessExecutor does (handle dropped), keeps one long-running
# child and one it waits for, then reports its children's states from /proc.
LAUNCHER = """
import json, os, subprocess, sys, threading, time
from pathlib import Path
from quorumfl.deploy.launch_gate import reap_children
stop = threading.Event()
if sys.argv[1] == "reap":
    threading.Thread(target=reap_children, args=(stop, 0.05), daemon=True).start()
# Never waited for, as Flower's executor does. The handles are kept so that subprocess's own
# clean-up (which polls dropped handles at the next Popen) cannot reap some of them by chance.
never_waited = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(5)]
running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
waited = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
time.sleep(3)
states = {}
for entry in Path("/proc").glob("[0-9]*"):
    try:
        fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        continue
    if int(fields[1]) == os.getpid():
        states[entry.name] = fields[0]
code = waited.wait(timeout=10)
running_alive = running.poll() is None
running.kill(); running.wait(timeout=10)
stop.set()
print(json.dumps({"zombies": sum(s == "Z" for s in states.values()), "running_alive": running_alive,
                  "waited": code}))
"""


def _launch(mode: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", LAUNCHER, mode], capture_output=True, text=True, timeout=60,
                         check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_reaper_leaves_no_defunct_app_process_and_spares_running_ones() -> None:
    without = _launch("plain")
    # The five never-waited children (what Flower's executor leaves today) and the one not yet waited.
    assert without["zombies"] == 6
    reaped = _launch("reap")
    assert reaped["zombies"] == 0
    assert reaped["running_alive"] is True
    # A child the reaper took first reads as exit 0 to subprocess; one reaped later keeps its code.
    assert reaped["waited"] in (0, 3)


def test_shim_runs_flowers_superexec(tmp_path: Path) -> None:
    script = write_superexec(tmp_path / "bin") / SUPEREXEC
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "--appio-api-address" in out.stdout or "superexec" in out.stdout.lower()
