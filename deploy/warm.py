"""Warm ClientApps: a node's ClientApp processes are forked from a process that has already imported
torch, Flower and QuorumFL, instead of each starting a fresh interpreter.

Flower's SuperExec starts ``flwr-clientapp`` once per message (train, each secure-aggregation stage,
evaluate). Importing torch, Flower and QuorumFL costs about 2.3 s of CPU per process, where the
stage itself often takes milliseconds: on two cores with ten nodes every round trip paid about
ten seconds of imports. Flower 1.42 has pre-started task workers only for its Kubernetes executor
(``flwr/supercore/task_worker.py``), and Python's ``multiprocessing`` forkserver runs functions, not
a program with its own argv, environment and standard streams, so this module is the small
fork server that does:

- the SuperExec (``launch_gate.superexec_main``, when its node has a warm server) does not start a
  ``flwr-clientapp`` process for a ClientApp task at all (``install_warm_launch``): a thread of its
  own takes the host slot as the gate would, then calls ``run_warm`` with the arguments Flower
  would have passed and the SuperExec's standard streams, and falls back to Flower's launch (the
  gate, below) when the warm server cannot be reached. Measured A/B on ten nodes and two cores,
  a masking run used 54-64 s of CPU against 67-75 s with a gate process per task (about 0.06 s of
  CPU each), and its consistency and unmask stages took 1.0-1.8 s against 1.3-2.2 s;
- the launch gate (``launch_gate.main``, run by the SuperExec as ``flwr-clientapp``) calls
  ``run_warm``: it connects to the warm server's Unix socket (starting the server first when none
  answers, under a lock), sends its argv, environment and working directory and passes its stdin,
  stdout and stderr as file descriptors (``SCM_RIGHTS``), then waits for the task's exit code and
  exits with it, forwarding SIGINT/SIGTERM/SIGHUP to the task;
- the warm server (``serve``) imports everything once, then for each request forks a child that
  takes over those streams, the environment and argv, resets its signal handlers and runs the
  same entry point the cold path would (Flower's ``flwr-clientapp``, behind ``app_guard`` when the
  server was started with the admin key). A task's crash ends only that child; its memory is the
  child's and is returned when it exits, as before.

Each task also sets glibc's allocator thresholds (``tune_malloc``, in the child only: the server
keeps glibc's defaults). By default a fresh process serves blocks from 128 KB up with a new ``mmap``
and gives freed memory back to the kernel, so nearly every temporary of a task's one big
computation (a CKKS encryption or partial decryption: dozens of 1-18 MB arrays) is zero-filled
page by page again. An encryption of 1.1M values in a fresh interpreter took 46,985 page faults
and 390 ms the first time, 9,808 faults with the thresholds set (32 MB below which blocks come from
the heap, which is not trimmed). In ten-node CKKS runs (three rounds, tasks timed from inside,
two runs each way taken in turns, the setting then made by the server before forking, which its
children inherit), a partial decryption's task section went from a median of 0.400 to 0.337 CPU-s
(30,240 to 14,755 page faults) and an encryption's from 0.505 to 0.486 (20,585 to 10,503). Whole
runs (four plaintext and four CKKS rounds, two each way in turns) differed by less than their
noise: the tasks' CPU 41.9-49.2 s with the setting, 42.2-45.8 s without. Blocks of 32 MB and more
still get their own ``mmap`` (and numpy's huge pages).

Trust: the socket lives in a 0700 directory of the node's home and the server answers only its own
user (``SO_PEERCRED``); the admin-signature check is decided by the server's own environment, never
by a request, and a request whose admin key setting differs from the server's is refused (that
requester then runs cold), so a guarded node never runs tasks through an unguarded server. The
SuperNode starts the server as it starts (``prestart``), not at its node's first task. The server
exits when the process that started it (the SuperNode, or a SuperExec) and every SuperExec whose
tasks it ran are gone. Any failure to reach or start it falls back to the cold path (a fresh
``flwr-clientapp``).

Standard library only at import: the gate imports this before anything heavy.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from quorumfl.deploy.launch_gate import (
    ADMIN_KEYS_ENV,
    CLIENTAPP,
    GATE_REAL_ENV,
    SLOT_HELD_ENV,
    WARM_ENV,
    slot_count,
    slot_wait,
    take_slot,
    write_gate,
)

__all__ = ["WARM_ENV", "install_warm_launch", "prestart", "run_warm", "serve", "warm_env"]

_MAX_REQUEST = 1 << 20
_HEADER = struct.Struct("!I")
_PID = struct.Struct("!q")
_CODE = struct.Struct("!i")
_SUN_PATH = 108  # bytes of sockaddr_un.sun_path on Linux, the terminating NUL included
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD = 32 << 20  # blocks below this come from the heap, not a fresh mmap (glibc's own dynamic ceiling)
TRIM_THRESHOLD = 1 << 30  # freed heap memory stays mapped for the task's next allocation
START_WAIT_S = 10.0  # a server not answering within this: the cold path (inside Flower's 30 s claim window)


def warm_env(directory: Path, *, path: str, env: Mapping[str, str]) -> dict[str, str]:
    """Environment entries that make a SuperNode's ClientApps warm: the launch gate (written to
    ``directory/bin``) first on ``path``, the warm server's socket in ``directory`` (0700), and
    Flower's own ``flwr-clientapp`` for the cold fallback (kept when ``env`` names one already)."""
    import shutil

    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)
    extra = {WARM_ENV: str(directory / "warm.sock")}
    if not env.get(GATE_REAL_ENV):  # Flower's own, beside this interpreter (PATH may hold a gate already)
        sibling = Path(sys.executable).parent / CLIENTAPP
        real = str(sibling) if os.access(sibling, os.X_OK) else shutil.which(CLIENTAPP, path=path)
        if real is None:
            return {}  # no Flower ClientApp on PATH: leave the node as it is (it fails there, clearly)
        extra[GATE_REAL_ENV] = real
    gate_dir = write_gate(directory / "bin")
    extra["PATH"] = os.pathsep.join([str(gate_dir), path])
    return extra


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


@contextlib.contextmanager
def _addressable(path: str) -> Iterator[str]:
    """``path`` as an AF_UNIX address: itself when it fits in ``sun_path`` (108 bytes with its NUL),
    else the same file reached through ``/proc/self/fd/N`` of its folder. A node's home deep in the
    filesystem (``~/.quorumfl/clientapp-warm/warm.sock`` under a long $HOME) went past the limit: the
    server died binding it and every task waited out ``START_WAIT_S``, then started cold."""
    if len(os.fsencode(path)) < _SUN_PATH:
        yield path
        return
    folder = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{os.path.basename(path)}"
    finally:
        os.close(folder)


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _addressable(path) as address:
            sock.connect(address)
    except OSError:
        sock.close()
        return None
    return sock


def _start_server(path: str, env: Mapping[str, str], watch_pid: int) -> socket.socket | None:
    """Connect to the warm server at ``path``, starting it first when none answers (one starter at a
    time, under ``path.lock``); None when it is not answering within ``START_WAIT_S``."""
    sock = _connect(path)
    if sock is not None:
        return sock
    directory = Path(path).parent
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(f"{path}.lock", "a+b") as lock:
        deadline = time.monotonic() + START_WAIT_S
        while True:  # another gate may be starting it: wait for the lock without blocking forever
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
        sock = _connect(path)
        if sock is not None:
            return sock
        server: subprocess.Popen[bytes] | None = None
        if not _starting(path):  # a server started by an earlier starter may still be importing
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            server_env = {k: v for k, v in env.items() if k != SLOT_HELD_ENV}
            log = open(directory / "warm-server.log", "ab")  # noqa: SIM115 (handed to the child)
            with log:
                server = subprocess.Popen([sys.executable, "-m", "quorumfl.deploy.warm", path, str(watch_pid)],
                                          env=server_env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                          start_new_session=True, close_fds=True)
            Path(f"{path}.starting").write_text(str(server.pid))
        while time.monotonic() < deadline:
            sock = _connect(path)
            if sock is not None:
                return sock
            if server is not None and server.poll() is not None:
                return None  # it died (its log says why): the cold path now, not after the whole wait
            time.sleep(0.05)
        return None


def _named_parent(args: Sequence[str]) -> int | None:
    """The SuperExec's pid from Flower's ``--parent-pid`` argument, None without one."""
    for i, arg in enumerate(args):
        if arg == "--parent-pid" and i + 1 < len(args) and args[i + 1].isdigit():
            return int(args[i + 1])
        if arg.startswith("--parent-pid="):
            value = arg.split("=", 1)[1]
            if value.isdigit():
                return int(value)
    return None


def _starting(path: str) -> bool:
    """Whether the server last started for ``path`` (its pid in ``path.starting``) is still alive:
    it binds the socket only once its imports are done, and a second one would import beside it."""
    try:
        pid = int(Path(f"{path}.starting").read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    try:  # a pid reused by another program is not our server
        return b"quorumfl.deploy.warm" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _parent_pid(args: Sequence[str]) -> int:
    """The SuperExec's pid from Flower's ``--parent-pid`` argument (else this process's parent)."""
    named = _named_parent(args)
    return os.getppid() if named is None else named


def prestart(env: Mapping[str, str], watch_pid: int) -> bool:
    """Start the warm server named by ``env[WARM_ENV]`` now, if none answers, so that a node's first
    ClientApp tasks find it warm: the SuperNode (``quorumfl.deploy.supernode``) calls this from a
    thread as it starts, so the server is its child (not the SuperLink's SuperExec's, which runs
    ServerApps). Otherwise a run's first tasks all wait on one server's imports (several seconds of
    CPU), and those that give up after ``START_WAIT_S`` start cold together. True when it answers."""
    path = env.get(WARM_ENV, "")
    if not path:
        return False
    try:
        sock = _start_server(path, env, watch_pid)
    except OSError:
        return False
    if sock is None:
        return False
    sock.close()  # an empty connection: the server closes it without a word
    return True


def run_warm(args: Sequence[str], env: Mapping[str, str], *, fds: Sequence[int] = (0, 1, 2),
             watch_pid: int | None = None, forward_signals: bool = True) -> int | None:
    """Run ``flwr-clientapp args`` as a child of the warm server named by ``env[WARM_ENV]``, with
    ``fds`` as its standard streams (this process's by default); its exit code, or None when no warm
    server could be reached (the caller then runs the cold path; nothing of the task has run).
    ``watch_pid``: the SuperExec the server lives with (default: Flower's ``--parent-pid``);
    ``forward_signals``: pass this process's SIGINT/SIGTERM/SIGHUP on to the task (main thread only)."""
    path = env.get(WARM_ENV, "")
    if not path:
        return None
    try:
        sock = _start_server(path, env, _parent_pid(args) if watch_pid is None else watch_pid)
    except OSError:
        return None
    if sock is None:
        return None
    with sock:
        request = json.dumps({"argv": list(args), "env": dict(env), "cwd": os.getcwd()}).encode()
        try:
            streams = array.array("i", list(fds))
            sock.sendmsg([_HEADER.pack(len(request)), request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, streams)])
            pid = _PID.unpack(_recv_exact(sock, _PID.size))[0]
        except (OSError, EOFError):
            return None  # the server refused or died before forking: nothing ran

        def forward(signum: int, _frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

        if forward_signals:
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, forward)
        try:
            return int(_CODE.unpack(_recv_exact(sock, _CODE.size))[0])
        except (OSError, EOFError):
            return 1  # the task ended without reporting (killed)


def _task_argv(spec: Any) -> list[str]:
    """The arguments Flower 1.42's ``SubprocessExecutor.launch`` gives ``flwr-clientapp`` for ``spec``."""
    args = ["--runtime-api-address", spec.runtime_api_address, "--token", spec.token]
    if spec.insecure:
        args.append("--insecure")
    elif spec.root_certificates_path is not None:
        args.extend(["--root-certificates", spec.root_certificates_path])
    if spec.parent_pid is not None:
        args.extend(["--parent-pid", str(spec.parent_pid)])
    if spec.runtime_dependency_install:
        args.append("--allow-runtime-dependency-installation")
    return args


def _launch_in_thread(spec: Any, cold: Any) -> None:
    """One ClientApp task handed to the warm server from a thread of the SuperExec: the host slot
    first (as the launch gate takes it), then the warm server; ``cold()`` when that cannot be reached
    or a slot setting is bad (the gate then says which and exits 78)."""
    env = dict(os.environ)
    held: int | None = None
    try:
        slots, wait = slot_count(env), slot_wait(env)
    except ValueError:  # Flower's launch runs the gate, which refuses the setting in one line (exit 78)
        cold()
        return
    try:
        if slots is not None:
            held = take_slot(env, slots, wait)
            if held is None:  # as the gate's exit 75: Flower starts the task again once its claim lapses
                return
        with contextlib.ExitStack() as stack:
            fds = [0, 1, 2]
            if spec.suppress_output:
                null = stack.enter_context(open(os.devnull, "r+b"))  # noqa: SIM115
                fds = [0, null.fileno(), null.fileno()]
            code = run_warm(_task_argv(spec), env, fds=fds, watch_pid=os.getpid(), forward_signals=False)
        if code is None:
            if held is not None:
                os.close(held)
                held = None
            cold()
    except (OSError, ValueError) as exc:
        print(f"quorumfl warm launch: {exc}", file=sys.stderr, flush=True)
    finally:
        if held is not None:
            os.close(held)


def install_warm_launch() -> bool:
    """In the SuperExec (``launch_gate.superexec_main``): hand ClientApp tasks to the warm server from
    a thread of this process instead of starting a ``flwr-clientapp`` launch gate for each (a Python
    process of its own, about 0.06 s of CPU per message). Other task types, and a task whose warm
    server cannot be reached, go through Flower's own launch (the gate). False when Flower's
    executor is not the one this was written for (then nothing changes)."""
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor import subprocess_executor
    from flwr.supercore.superexec.executor.types import LaunchResult

    executor = subprocess_executor.SubprocessExecutor
    flower_launch = executor.launch
    if getattr(flower_launch, "__qualname__", "") != "SubprocessExecutor.launch":
        return False

    def launch(self: Any, spec: Any) -> Any:
        if spec.task_type != TaskType.CLIENT_APP or not os.environ.get(WARM_ENV):
            return flower_launch(self, spec)
        threading.Thread(target=_launch_in_thread, args=(spec, lambda: flower_launch(self, spec)),
                         name=f"clientapp-task-{spec.task_id}", daemon=True).start()
        return LaunchResult.accepted()

    executor.launch = launch  # type: ignore[method-assign]
    return True


def _entry(own_env: Mapping[str, str]) -> int:
    """The task's entry point, as the cold path would run it; the guard decided by ``own_env``."""
    tune_malloc()
    try:
        if own_env.get(ADMIN_KEYS_ENV):
            os.environ[ADMIN_KEYS_ENV] = own_env[ADMIN_KEYS_ENV]
            from quorumfl.deploy.app_guard import main as guarded

            guarded()
        else:
            from flwr.supernode.cli import flwr_clientapp

            flwr_clientapp()
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 (the child reports any failure as its exit code)
        import traceback

        traceback.print_exc()
        return 1
    return 0


def _end_with_requester(conn: socket.socket) -> None:
    """The task ends with the process that asked for it (the SuperExec's ``flwr-clientapp``): the
    requester sends nothing more, so a read returns only when it is gone, as after ``kill -9``."""
    with contextlib.suppress(OSError):
        conn.recv(1)
    os.kill(os.getpid(), signal.SIGKILL)


def _child(conn: socket.socket, listener: socket.socket, request: dict[str, object], fds: list[int],
           own_env: Mapping[str, str]) -> None:
    """In the forked child: take over the requester's streams, environment and argv; run the task."""
    code = 1
    try:
        listener.close()
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        env = request["env"]
        argv = request["argv"]
        assert isinstance(env, dict) and isinstance(argv, list)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        with contextlib.suppress(OSError):
            os.chdir(str(request["cwd"]))
        sys.argv = [CLIENTAPP, *map(str, argv)]
        with contextlib.suppress(OSError):  # what ps/top show as the process name
            Path("/proc/self/comm").write_text(CLIENTAPP)
        conn.sendall(_PID.pack(os.getpid()))
        threading.Thread(target=_end_with_requester, args=(conn,), daemon=True).start()
        code = _entry(own_env)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(OSError):
            conn.sendall(_CODE.pack(code))
        os._exit(code & 0xFF if code >= 0 else 1)


def _preload() -> None:
    """Import what every ClientApp imports, so forked tasks start with it in memory.

    Measured with a profile of every task (3 nodes, plaintext, masking and CKKS rounds): a training
    task spent 2.5 of its 3.5 s importing ``torch._dynamo``, which torch's optimizers import on
    first construction, and every task ~0.05 s importing Flower's HTTP client (httpx, whose
    transport imports httpcore and h11 on first use: 0.4 s per task with ten nodes on two cores)
    and cryptography's OpenSSL backend; the round's own modules (``client.steps`` and what it
    pulls in) another ~0.4 s."""
    import cryptography.hazmat.backends.openssl  # noqa: F401
    import flwr.supernode.cli  # noqa: F401
    import flwr.supernode.runtime.run_clientapp  # noqa: F401
    import h11  # noqa: F401
    import httpcore  # noqa: F401
    import httpx  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401

    import quorumfl.client.app  # noqa: F401
    import quorumfl.client.steps  # noqa: F401
    import quorumfl.deploy.app_guard  # noqa: F401
    import quorumfl.privacy.admin  # noqa: F401

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # any first-use set-up, once
    from quorumfl.protocol.pull_backoff import shorten_pull_backoff
    from quorumfl.protocol.reply_push import retry_reply_push

    shorten_pull_backoff()  # every forked task inherits the shorter object-pull backoff
    retry_reply_push()  # and the reply push that survives a repeated object push


def tune_malloc() -> bool:
    """Serve blocks under ``MMAP_THRESHOLD`` from the heap and keep freed heap memory mapped for reuse
    (glibc ``mallopt``; module docstring); False where the C library has no ``mallopt`` or refuses the
    values. For a task's own process only: it holds memory it freed until it exits."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def serve(path: str, watch_pid: int) -> int:
    """Preload, then fork a task for each request on the Unix socket ``path`` until ``watch_pid``
    (the SuperNode or SuperExec that started it) and every SuperExec a request named (Flower's ``--parent-pid``) are gone: nodes
    that share a server (a local federation's) keep it when the node that started it is killed.
    Single-threaded, so every fork copies a consistent process."""
    own_env = dict(os.environ)
    watched = {watch_pid}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    with _addressable(tmp) as address:
        listener.bind(address)  # before the imports: a socket that cannot be made fails in milliseconds
    os.chmod(tmp, 0o600)
    _preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    os.replace(tmp, path)  # appears only once the imports are done: a connect means warm
    listener.listen(64)
    listener.settimeout(1.0)
    print(f"warm ClientApp server {os.getpid()} on {path}", flush=True)
    uid = os.getuid()
    while True:
        for pid in list(watched):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                watched.discard(pid)
            except PermissionError:
                pass
        if not watched:
            break
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            break
        conn.settimeout(10.0)
        fds = []
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != uid:
                raise PermissionError("peer is another user")
            fds_array = array.array("i")
            header, ancdata, _flags, _addr = conn.recvmsg(_HEADER.size, socket.CMSG_SPACE(3 * fds_array.itemsize))
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds_array.frombytes(data[: len(data) - (len(data) % fds_array.itemsize)])
            fds = list(fds_array)
            if not header and not fds:  # a connection closed unused (``prestart``): nothing to answer
                conn.close()
                continue
            if len(header) < _HEADER.size:
                header += _recv_exact(conn, _HEADER.size - len(header))
            (size,) = _HEADER.unpack(header)
            if len(fds) != 3 or size > _MAX_REQUEST:
                raise ValueError("malformed request")
            request = json.loads(_recv_exact(conn, size))
            if not isinstance(request, dict) or not isinstance(request.get("argv"), list) \
                    or not isinstance(request.get("env"), dict):
                raise ValueError("malformed request")
            if request["env"].get(ADMIN_KEYS_ENV, "") != own_env.get(ADMIN_KEYS_ENV, ""):
                # A node whose ClientApps must run only admin-signed apps never shares a server that
                # was started without that check (or with another admin key), nor the other way round.
                raise PermissionError(f"{ADMIN_KEYS_ENV} differs from this server's")
        except (OSError, ValueError, EOFError, struct.error) as exc:
            print(f"refused a request: {exc}", flush=True)
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        conn.settimeout(None)
        named = _named_parent(request["argv"])
        if named is not None and named > 1:
            watched.add(named)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            _child(conn, listener, request, fds, own_env)
        for fd in fds:
            os.close(fd)
        conn.close()
    return 0  # the socket file stays: a gate that cannot connect to it starts a new server


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], int(sys.argv[2])))
