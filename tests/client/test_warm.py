"""Warm ClientApps and the SuperNode's poll: a task forked from the warm server runs Flower's real
``flwr-clientapp`` with the requester's argv and streams and returns its exit code; without a warm
server the gate falls back to the cold path; the admin-signature guard is the server's to decide,
not the request's; the SuperNode's waits are shortened only where Flower sleeps; a task keeps the
memory it frees for its next allocation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from quorumfl.deploy import warm
from quorumfl.deploy.launch_gate import ADMIN_KEYS_ENV, GATE_REAL_ENV, WARM_ENV
from quorumfl.deploy.processes import _process_table
from quorumfl.deploy.supernode import (
    DEFAULT_POLL_S,
    LOCAL_WAIT_S,
    POLL_ENV,
    patch_waits,
    poll_interval,
)
from quorumfl.deploy.warm import prestart, run_warm, warm_env

GATE = [sys.executable, "-c", "import sys; from quorumfl.deploy.launch_gate import main; sys.exit(main())"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUORUMFL_")}
    env.update(warm_env(tmp_path / "warm", path=env.get("PATH", ""), env=env))
    env.update(extra)
    return env


def _server_pids(tmp_path: Path) -> set[int]:
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"quorumfl.deploy.warm" in cmdline and str(tmp_path).encode() in b" ".join(cmdline):
            found.add(int(entry.name))
    return found


@pytest.fixture
def servers(tmp_path: Path):  # type: ignore[no-untyped-def]
    yield
    for pid in _server_pids(tmp_path):
        os.kill(pid, signal.SIGKILL)


def _superexec() -> subprocess.Popen[bytes]:
    """A process that stands for a SuperExec: it only lives until killed."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])


def _gate_help(env: dict[str, str], superexec: int) -> None:
    """A ClientApp task (``flwr-clientapp --help``) through the gate for ``superexec``; it must succeed."""
    shown = subprocess.run([*GATE, "--parent-pid", str(superexec), "--help"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr


def _until_no_server(tmp_path: Path, message: str) -> None:
    deadline = time.monotonic() + 15
    while _server_pids(tmp_path):
        assert time.monotonic() < deadline, message
        time.sleep(0.2)


def test_a_warm_task_runs_flowers_clientapp_with_the_callers_argv_streams_and_exit_code(
        tmp_path: Path, servers: None) -> None:
    env = _env(tmp_path)
    # Flower's flwr-clientapp refuses an unknown flag with argparse's exit code 2 on stderr.
    first = subprocess.run([*GATE, "--token", "t", "--no-such-flag"], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 2, first.stderr
    assert "--no-such-flag" in first.stderr and "flwr-clientapp" in first.stderr
    assert len(_server_pids(tmp_path)) == 1  # the first call started the warm server
    log = (tmp_path / "warm" / "warm-server.log").read_text()
    assert "warm ClientApp server" in log
    shown = subprocess.run([*GATE, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "Run a Flower ClientApp" in shown.stdout
    assert len(_server_pids(tmp_path)) == 1  # the second call was forked by the same server


def test_without_a_warm_server_the_gate_runs_the_cold_clientapp(tmp_path: Path) -> None:
    cold = tmp_path / "cold-clientapp"
    cold.write_text("#!/bin/sh\necho cold \"$@\"\nexit 5\n")
    cold.chmod(0o755)
    env = _env(tmp_path, **{WARM_ENV: "/proc/no-such-dir/warm.sock", GATE_REAL_ENV: str(cold)})
    result = subprocess.run([*GATE, "--x"], env=env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (5, "cold --x")
    assert run_warm(["--x"], {WARM_ENV: ""}) is None


def test_a_request_cannot_drop_the_servers_admin_guard(tmp_path: Path, servers: None) -> None:
    """A server started for a node that runs only admin-signed apps runs every task through
    app_guard (which fails closed here: the key file is missing, exit 78), and serves no request
    whose admin key setting differs from its own, in either direction: a guarded node never runs
    tasks through an unguarded server."""
    env = _env(tmp_path, **{ADMIN_KEYS_ENV: str(tmp_path / "missing-admin.pub")})
    guarded = subprocess.run([*GATE, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert guarded.returncode == 78 and "refusing to run any app" in guarded.stderr
    [server] = _server_pids(tmp_path)
    probe = "import os; from quorumfl.deploy.warm import run_warm; print(run_warm(['--help'], os.environ))"
    for changed in ({k: v for k, v in env.items() if k != ADMIN_KEYS_ENV}, {**env, ADMIN_KEYS_ENV: "/other/admin.pub"}):
        result = subprocess.run([sys.executable, "-c", probe], env=changed, capture_output=True, text=True, timeout=120)
        assert result.stdout.strip() == "None", result.stderr  # refused before anything was forked
    assert _server_pids(tmp_path) == {server}
    assert (tmp_path / "warm" / "warm-server.log").read_text().count(f"{ADMIN_KEYS_ENV} differs") == 2

    # An unguarded server (started for a node without the check) refuses a guarded request the same way.
    plain = tmp_path / "plain"
    plain_env = {k: v for k, v in os.environ.items() if not k.startswith("QUORUMFL_")}
    plain_env.update(warm_env(plain, path=plain_env.get("PATH", ""), env=plain_env))
    assert subprocess.run([*GATE, "--help"], env=plain_env, capture_output=True, timeout=120).returncode == 0
    result = subprocess.run([sys.executable, "-c", probe], env={**plain_env, ADMIN_KEYS_ENV: str(tmp_path / "k")},
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "None", result.stderr


def test_supernode_waits_are_shortened_only_where_flower_sleeps(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    module = ModuleType("flower_loop")
    module.time = time  # type: ignore[attr-defined]
    patch_waits(module, 0.4)
    module.time.sleep(3)  # type: ignore[attr-defined]
    module.time.sleep(0.5)  # type: ignore[attr-defined]
    assert slept == [0.4, LOCAL_WAIT_S]
    assert module.time.monotonic is time.monotonic  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="no longer uses the time module"):
        patch_waits(module, 0.4)  # already patched: not the time module any more


def test_flowers_supernode_loop_is_what_the_patch_expects() -> None:
    from flwr.supernode import start_client_internal

    assert start_client_internal.time is time  # Flower 1.42: `import time` and `time.sleep(3)` when idle
    source = Path(start_client_internal.__file__).read_text()
    assert "time.sleep(3)" in source


# A fresh interpreter fills an 8 MB block, frees it, and counts the page faults of filling a second one.
_REFILL_FAULTS = """
import resource, sys
from quorumfl.deploy.warm import tune_malloc
if sys.argv[1] == "tuned" and not tune_malloc():
    sys.exit("mallopt refused")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
first = bytearray(8 << 20)  # zero-filled: every page touched
del first
before = faults()
second = bytearray(8 << 20)
print(faults() - before)
"""


def _refill_faults(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", _REFILL_FAULTS, mode], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


def test_a_tuned_task_refills_memory_it_freed_without_new_page_faults() -> None:
    pages = (8 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert _refill_faults("default") >= pages // 2  # glibc's defaults give the block back and fault it in again
    assert _refill_faults("tuned") < pages // 16  # the heap keeps it for the second block


def test_a_warm_task_tunes_its_allocator_before_flower_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    import flwr.supernode.cli

    calls: list[str] = []
    monkeypatch.setattr(warm, "tune_malloc", lambda: calls.append("tune") or True)
    monkeypatch.setattr(flwr.supernode.cli, "flwr_clientapp", lambda: calls.append("clientapp"))
    assert warm._entry({}) == 0
    assert calls == ["tune", "clientapp"]


def test_poll_interval_is_checked() -> None:
    assert poll_interval({}) == DEFAULT_POLL_S
    assert poll_interval({POLL_ENV: "1.5"}) == 1.5
    for bad in ("0", "fast", "10"):
        with pytest.raises(ValueError, match=POLL_ENV):
            poll_interval({POLL_ENV: bad})


def _tasks_of(server_pids: set[int]) -> set[int]:
    return {pid for pid, (ppid, _state, _start) in _process_table().items() if ppid in server_pids}


def _running(pid: int) -> bool:
    entry = _process_table().get(pid)
    return entry is not None and entry[1] not in ("Z", "X")


def test_a_task_ends_with_the_process_that_asked_for_it(tmp_path: Path, servers: None) -> None:
    """``kill -9`` of the SuperExec's flwr-clientapp (the gate) ends the warm task too, as it ended
    the cold ClientApp: nothing keeps running behind the SuperExec's back."""
    env = _env(tmp_path)
    # No Runtime API answers on port 9: Flower's ClientApp keeps retrying, so the task stays alive.
    gate = subprocess.Popen([*GATE, "--token", "t", "--insecure", "--runtime-api-address", "127.0.0.1:9"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        # a forked task names itself once it has taken over the request (it may be seen just before)
        while not (tasks := _tasks_of(_server_pids(tmp_path))) or \
                {Path(f"/proc/{pid}/comm").read_text().strip() for pid in tasks} != {"flwr-clientapp"}:
            assert time.monotonic() < deadline, f"no warm task named flwr-clientapp started: {tasks}"
            time.sleep(0.1)
        assert gate.poll() is None
        gate.kill()
        gate.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(map(_running, tasks)):
            assert time.monotonic() < deadline, "the warm task outlived its requester"
            time.sleep(0.1)
    finally:
        gate.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_is_not_served_even_through_an_open_socket(tmp_path: Path, servers: None) -> None:
    """The socket sits in a 0700 folder; opened up on purpose, the server still serves only its own
    user (SO_PEERCRED): another user's request is refused before anything is forked."""
    import tempfile

    open_dir = Path(tempfile.mkdtemp(prefix="quorumfl-warm-test-"))
    try:
        env = _env(tmp_path, **{WARM_ENV: str(open_dir / "warm.sock")})
        assert subprocess.run([*GATE, "--help"], env=env, capture_output=True, timeout=120).returncode == 0
        servers_now = _server_pids(open_dir)
        assert len(servers_now) == 1
        open_dir.chmod(0o777)
        (open_dir / "warm.sock").chmod(0o666)
        before = _tasks_of(servers_now)
        # Imports first (the interpreter lives under root's home), then become nobody and ask.
        probe = ("import os; from quorumfl.deploy.warm import run_warm; os.setgid(65534); os.setuid(65534); "
                 f"print(run_warm(['--help'], {{'QUORUMFL_CLIENTAPP_WARM': {str(open_dir / 'warm.sock')!r}}}))")
        result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert result.stdout.strip() == "None", result.stderr  # refused: that caller would go cold, as itself
        assert not _tasks_of(servers_now) - before  # nothing new forked (the --help task may have ended)
        assert "refused a request: peer is another user" in (open_dir / "warm-server.log").read_text()
    finally:
        for pid in _server_pids(open_dir):
            os.kill(pid, signal.SIGKILL)
        import shutil

        shutil.rmtree(open_dir, ignore_errors=True)


def test_the_server_exits_with_the_superexec_that_started_it(tmp_path: Path, servers: None) -> None:
    superexec = _superexec()
    try:
        env = _env(tmp_path)
        _gate_help(env, superexec.pid)
        assert len(_server_pids(tmp_path)) == 1
    finally:
        superexec.kill()
        superexec.wait(timeout=10)
    _until_no_server(tmp_path, "the warm server outlived its SuperExec")


def test_prestart_starts_the_server_before_any_task_and_leaves_no_refusal(tmp_path: Path, servers: None) -> None:
    superexec = _superexec()
    try:
        env = _env(tmp_path)
        assert not _server_pids(tmp_path)
        assert prestart(env, superexec.pid)
        assert len(_server_pids(tmp_path)) == 1 and not _tasks_of(_server_pids(tmp_path))
        assert prestart(env, superexec.pid)  # answers: no second server
        assert len(_server_pids(tmp_path)) == 1
        log = (tmp_path / "warm" / "warm-server.log").read_text()
        assert "refused" not in log, log
    finally:
        superexec.kill()
        superexec.wait(timeout=10)


def test_the_server_lives_while_a_superexec_it_served_lives(tmp_path: Path, servers: None) -> None:
    """Nodes sharing a server (a local federation's): killing the node that started it leaves it to
    the others; it exits once the last SuperExec it served is gone."""
    starter, other = (_superexec() for _ in range(2))
    try:
        env = _env(tmp_path)
        assert prestart(env, starter.pid)
        _gate_help(env, other.pid)
        (server,) = _server_pids(tmp_path)
        starter.kill()
        starter.wait(timeout=10)
        time.sleep(3)  # the server checks its SuperExecs once a second
        assert _server_pids(tmp_path) == {server}
        _gate_help(env, other.pid)
        assert _server_pids(tmp_path) == {server}  # served by it, not by a new one
    finally:
        starter.kill()
        other.kill()
        other.wait(timeout=10)
    _until_no_server(tmp_path, "the warm server outlived the SuperExecs it served")


def test_a_server_still_importing_is_waited_for_not_doubled(tmp_path: Path, servers: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten nodes' SuperExecs prestart at once on busy cores: one whose wait ran out while the server
    it started was still importing must not leave the next starter to import a second one beside it."""
    from quorumfl.deploy import warm

    monkeypatch.setattr(warm, "START_WAIT_S", 1.0)
    env = _env(tmp_path)
    # stands for a server that is alive and still importing (its socket is not bound yet)
    importing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "quorumfl.deploy.warm"])
    superexec = _superexec()
    try:
        deadline = time.monotonic() + 30  # until it has exec'd: before that /proc shows pytest's argv
        while b"quorumfl.deploy.warm" not in Path(f"/proc/{importing.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.01)
        Path(f"{env[WARM_ENV]}.starting").write_text(str(importing.pid))
        assert not prestart(env, superexec.pid)  # waited, started nothing
        assert not _server_pids(tmp_path)
        importing.kill()
        importing.wait(timeout=10)
        monkeypatch.setattr(warm, "START_WAIT_S", 60.0)
        assert prestart(env, superexec.pid)  # that one died: a new server starts
        assert len(_server_pids(tmp_path)) == 1
    finally:
        importing.kill()
        superexec.kill()
        superexec.wait(timeout=10)


def test_a_home_deeper_than_a_unix_socket_address_still_gets_a_warm_server(tmp_path: Path, servers: None) -> None:
    """A socket path is at most 108 bytes (``sun_path``); a node whose home lies deeper once had its
    server die at ``bind`` and every task wait 10 s, then start cold (22 s per masked stage)."""
    deep = tmp_path / ("department-home-" * 8)
    env = _env(deep)
    assert len(os.fsencode(env[WARM_ENV])) > 108
    superexec = _superexec()
    try:
        began = time.monotonic()
        _gate_help(env, superexec.pid)
        assert len(_server_pids(deep)) == 1, (deep / "warm" / "warm-server.log").read_text()
        assert Path(env[WARM_ENV]).is_socket()
        assert "Traceback" not in (deep / "warm" / "warm-server.log").read_text()
        assert time.monotonic() - began < 60
    finally:
        superexec.kill()
        superexec.wait(timeout=10)
