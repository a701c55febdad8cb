"""Launch gate: a ClientApp process waits for a host slot before Flower's ``flwr-clientapp`` starts.

Flower's SuperExec starts ``flwr-clientapp`` by name for every message. On a host whose department
nodes share K host slots (``quorumfl node start --host-slots K``), a generated ``flwr-clientapp``
placed first on the nodes' PATH runs ``main`` here: it waits for one of the K ``flock`` slots, then
execs Flower's real ``flwr-clientapp``, which inherits the slot and holds it until it ends (the kernel
frees it then, even after ``kill -9``).

Why before Flower starts rather than inside the ClientApp: a claimed task must send its first
heartbeat within Flower's claim window (``HEARTBEAT_DEFAULT_INTERVAL``, 30 s) or it returns to
pending and the SuperExec starts another process for it. Fifty nodes on two cores, all starting a
ClientApp (Flower's own imports, about 1.3 s of CPU each) in the same seconds, miss the window
together, and each retry adds processes (seen: 287 ClientApps for 50 nodes, memory exhausted).
Waiting here costs a bare interpreter; a process that has no slot after ``wait`` seconds (less than
the claim window) exits before Flower's code runs, and Flower starts the task again once its claim
lapses. Flower's subprocess executor has no launch limit (its capacity gate is for Kubernetes), and
nothing else bounds processes across independent nodes: a lock file per slot is the smallest thing
that does.

The same folder holds a ``flower-superexec`` (``write_superexec``) that runs Flower's SuperExec with
a reaper thread (``reap_children``): Flower's subprocess executor starts every app process with
``subprocess.Popen`` and drops the handle, so each finished app process stays a ``<defunct>`` entry
until the next launch. Flower has no hook for this; the reaper waits only for children that have
already exited, which is all the executor's discarded handles would ever do.

Standard library and ``quorumfl.core.slots`` only: this runs before anything heavy is imported.
"""

from __future__ import annotations

import math
import os
import stat
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from quorumfl.core.slots import (
    SLOT_HELD_ENV,
    SLOTS_DIR_ENV,
    SLOTS_ENV,
    acquire_slot,
    slot_count,
    slot_directory,
)

__all__ = [
    "ADMIN_KEYS_ENV",
    "GATE_REAL_ENV",
    "GATE_WAIT_ENV",
    "SLOTS_DIR_ENV",
    "SLOTS_ENV",
    "SLOT_HELD_ENV",
    "SUPEREXEC",
    "acquire_slot",
    "main",
    "reap_children",
    "slot_count",
    "slot_directory",
    "slot_wait",
    "superexec_main",
    "take_slot",
    "write_gate",
    "write_superexec",
]

GATE_REAL_ENV = "QUORUMFL_CLIENTAPP_REAL"  # Flower's own flwr-clientapp
GATE_WAIT_ENV = "QUORUMFL_CLIENTAPP_GATE_WAIT"
ADMIN_KEYS_ENV = "QUORUMFL_ADMIN_KEYS"  # the admin's public keys: the ClientApp runs behind app_guard
CLIENTAPP = "flwr-clientapp"
WARM_ENV = "QUORUMFL_CLIENTAPP_WARM"  # warm.WARM_ENV: the warm server's socket (warm ClientApps)
SUPEREXEC = "flower-superexec"


def slot_wait(env: Mapping[str, str]) -> float:
    """How long a task waits for a host slot (``QUORUMFL_CLIENTAPP_GATE_WAIT``, 18 s by default).
    Raises ValueError naming the variable unless it is a number of seconds in (0, 3600)."""
    raw = env.get(GATE_WAIT_ENV, "18")
    try:
        wait = float(raw)
    except ValueError:
        wait = math.nan
    if not 0 < wait < 3600:
        raise ValueError(f"{GATE_WAIT_ENV}={raw!r} must be a number of seconds between 0 and 3600")
    return wait


def take_slot(env: dict[str, str], slots: int, wait: float) -> int | None:
    """Take one of ``slots`` host slots within ``wait`` seconds for a task started with ``env``: the
    fd holding it, with ``SLOT_HELD_ENV`` set in ``env`` (the task then does not take another); None
    after saying on stderr that none was free (Flower starts the task again once its claim lapses)."""
    held = acquire_slot(slot_directory(env), slots, timeout=wait)
    if held is None:
        print(f"quorumfl launch gate: no host slot free within {wait:g} s; Flower starts the task again",
              file=sys.stderr, flush=True)
        return None
    env[SLOT_HELD_ENV] = str(held[1])
    return held[0]


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Wait for a slot, then exec the real ``flwr-clientapp`` with ``argv``; 75 (EX_TEMPFAIL) when
    no slot came within the wait, 78 (EX_CONFIG) on a bad setting."""
    args = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ if env is None else env)
    real = environ.get(GATE_REAL_ENV, "")
    guarded = bool(environ.get(ADMIN_KEYS_ENV))
    try:
        slots = slot_count(environ)
        wait = slot_wait(environ)
        if not guarded and (not real or not os.access(real, os.X_OK)):
            raise ValueError(f"{GATE_REAL_ENV}={real!r} must name Flower's executable flwr-clientapp")
    except ValueError as exc:
        print(f"quorumfl launch gate: {exc}", file=sys.stderr)
        return 78
    if slots is not None:
        fd = take_slot(environ, slots, wait)
        if fd is None:
            return 75
        os.set_inheritable(fd, True)
    if environ.get(WARM_ENV):  # forked from the warm server, which has everything imported
        from quorumfl.deploy.warm import run_warm

        code = run_warm(args, environ)
        if code is not None:
            return code
    if guarded:  # Flower's flwr-clientapp behind the admin-signature check (app_guard)
        os.execve(sys.executable, [sys.executable, "-m", "quorumfl.deploy.app_guard", *args], environ)
    os.execve(real, [real, *args], environ)
    return 0  # not reached: execve replaces this process


def _write_script(bin_dir: Path, name: str, comment: str, entry: str, python: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / name
    body = (f"#!{python}\n"
            f"# Generated by QuorumFL: {comment}\n"
            "import sys\n"
            f"from quorumfl.deploy.launch_gate import {entry}\n"
            f"sys.exit({entry}())\n")
    tmp = script.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(body)
    tmp.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    tmp.replace(script)
    return bin_dir


def write_gate(bin_dir: Path, *, python: str = sys.executable) -> Path:
    """Write the gate as ``bin_dir/flwr-clientapp`` (run by ``python``); returns ``bin_dir``, to put
    first on the nodes' PATH."""
    return _write_script(bin_dir, CLIENTAPP, "waits for a host slot, then runs Flower's flwr-clientapp "
                         "(behind the admin-signature check when QUORUMFL_ADMIN_KEYS is set).", "main", python)


def write_superexec(bin_dir: Path, *, python: str = sys.executable) -> Path:
    """Write ``bin_dir/flower-superexec``: Flower's SuperExec with ``reap_children`` running beside it;
    returns ``bin_dir``, to put first on the PATH of SuperLinks and SuperNodes (they start their
    SuperExec by name)."""
    return _write_script(bin_dir, SUPEREXEC, "Flower's flower-superexec, reaping the app processes it starts.",
                         "superexec_main", python)


def reap_children(stop: threading.Event, interval: float = 0.25) -> None:
    """Until ``stop`` is set: wait for this process's children that have already exited, so none
    stays ``<defunct>``. ``WNOWAIT`` first names an exited child without touching a running one;
    a child some other code reaps in between is skipped (``subprocess`` treats a child reaped
    elsewhere as exit 0, and Flower's executor never asks)."""
    while not stop.is_set():
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # no children at all
            info = None
        if info is None:
            stop.wait(interval)
            continue
        try:
            os.waitpid(info.si_pid, os.WNOHANG)
        except ChildProcessError:
            pass


def superexec_main() -> int:
    """Flower's ``flower-superexec`` (same arguments) with ``reap_children`` on a daemon thread, and
    woken by its SuperNode between asks for new tasks (``task_wake``) when the SuperNode set that up."""
    from quorumfl.deploy.task_wake import WakeableSleep

    threading.Thread(target=reap_children, args=(threading.Event(),), name="reap-app-processes",
                     daemon=True).start()
    sleeper = WakeableSleep.from_env()
    if sleeper is not None:
        import importlib

        loop: Any = importlib.import_module("flwr.supercore.superexec.run_superexec")  # the module, not its function
        if getattr(loop, "time", None) is time:
            loop.time = sleeper
        else:  # Flower changed its loop: keep polling as configured
            sleeper.close()
    if os.environ.get(WARM_ENV):
        from quorumfl.deploy.warm import install_warm_launch

        install_warm_launch()
    from flwr.supercore.cli import flower_superexec

    flower_superexec()
    return 0
