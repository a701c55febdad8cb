"""``ProcessGroup`` stops every process its children started, including one spawned in a session of
its own while its parent was shutting down (as Flower's SuperNode can do with a ClientApp): such a
process is reparented to init, so the process tree alone no longer leads to it. ``node start``'s
record of its key, and its retries of a SuperNode the SuperLink refuses (``--rejoin-wait``, counted
from the first refusal)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from quorumfl.cli import cmd_federation
from quorumfl.deploy.processes import ACTIVATION_REFUSED, ProcessGroup
from quorumfl.errors import CredentialError

# On SIGTERM: start a detached process (new session, survives its parent) that writes its pid, wait
# until it did, and exit.
SPAWN_ON_TERM = """
import pathlib, signal, subprocess, sys, time
pid_file = pathlib.Path(sys.argv[1])
def on_term(*_):
    subprocess.Popen([sys.executable, "-c",
                      "import os, pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(300)",
                      str(pid_file)], start_new_session=True)
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.01)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_stop_all_ends_a_process_spawned_during_shutdown(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    with ProcessGroup(tmp_path / "logs", dict(os.environ)) as group:
        child = group.start("spawner", [sys.executable, "-c", SPAWN_ON_TERM, str(pid_file)])
        deadline = time.monotonic() + 30
        while "ready" not in child.output():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
    # Leaving the group stopped the child, which started the grandchild on its way out.
    grandchild = int(pid_file.read_text())
    try:
        assert not _alive(grandchild), "the process spawned during shutdown was left running"
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_node_presence_locks_one_node_per_key_and_times_the_rejoin(tmp_path: Path) -> None:
    """`node start`'s record of its key: a second holder is refused naming the first's pid; a refusal
    is worth retrying only within the SuperLink's grace after this key was last connected here."""
    from quorumfl.deploy.processes import REJOIN_GRACE_S, NodePresence

    first = NodePresence(tmp_path / "run", b"key-a")
    first.acquire("a node with --department parks")
    assert NodePresence(tmp_path / "run", b"key-b").rejoin_wait() == 0.0  # never connected: refuse at once
    with pytest.raises(CredentialError, match=rf"already runs on this machine \(pid {os.getpid()}\)"):
        NodePresence(tmp_path / "run", b"key-a").acquire("a node with --department parks")
    other = NodePresence(tmp_path / "run", b"key-b")
    other.acquire("another key")  # another key is free
    other.release()
    first.connected()
    assert REJOIN_GRACE_S - 5 < first.rejoin_wait() <= REJOIN_GRACE_S
    long_ago = time.time() - REJOIN_GRACE_S - 1
    os.utime(first.stamp_path, (long_ago, long_ago))
    assert first.rejoin_wait() == 0.0  # the SuperLink has let go of that SuperNode by now
    first.release()
    again = NodePresence(tmp_path / "run", b"key-a")
    again.acquire("a node with --department parks")  # released: free again
    again.release()


# A stand-in SuperNode that the SuperLink refuses: it takes ``argv[2]`` seconds to start, logs Flower's
# refusal and exits with an error; every start appends a line to ``argv[1]``.
REFUSED_AFTER = f"""
import pathlib, sys, time
with pathlib.Path(sys.argv[1]).open("a") as starts:
    starts.write("start\\n")
time.sleep(float(sys.argv[2]))
print("ERROR :      {ACTIVATION_REFUSED}: the key is not known", flush=True)
sys.exit(1)
"""


def test_a_refused_node_is_tried_again_for_the_wait_counted_from_its_first_refusal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`node start --rejoin-wait 1` where the SuperNode takes longer than the wait to start and be
    refused (a loaded machine: the CI run where it took over 5 s): it is still started again, and the
    error's "kept trying" is true. Counted from the start, the first refusal came after the deadline
    and the node gave up without one retry."""
    monkeypatch.setattr(cmd_federation, "REJOIN_RETRY_S", 0.1)
    starts = tmp_path / "starts"
    with pytest.raises(CredentialError, match=r"refused node-parks's key \(kept trying for 1 s\)"):
        cmd_federation._run_in_foreground(
            dict(os.environ), tmp_path / "logs", "node-parks",
            [sys.executable, "-c", REFUSED_AFTER, str(starts), "1.5"], lambda child: None, rejoin_wait=1.0)
    assert starts.read_text().count("start") == 2  # refused at 1.5 s, tried again, refused 1.5 s later: past the wait
    assert "trying again" in capsys.readouterr().out


def test_a_refusal_is_final_at_once_without_a_rejoin_wait(tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    with pytest.raises(CredentialError, match=r"refused node-parks's key: the key is not registered"):
        cmd_federation._run_in_foreground(
            dict(os.environ), tmp_path / "logs", "node-parks",
            [sys.executable, "-c", REFUSED_AFTER, str(starts), "0"], lambda child: None, rejoin_wait=0.0)
    assert starts.read_text().count("start") == 1
