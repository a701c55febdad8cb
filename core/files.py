"""Where QuorumFL keeps its files, atomic file writes, and reads that notice a file changing under them.

``default_home()`` is the one lookup of the QuorumFL home (``$QUORUMFL_HOME``, else ``~/.quorumfl``):
the state DB, model store, logs, and a node's own keys and state live under it unless configured.

Atomic file writes: a crash leaves either the old file or the new one, never a torn one.

The bytes go to a temporary file in the same folder (created with ``mode``), are fsynced and renamed
over the final name, and the folder is fsynced so the rename itself survives a power loss. Model
files, partitions, node key material and personal model state are all written this way.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["HOME_ENV", "FileChangedError", "atomic_write", "default_home", "read_unchanged"]

HOME_ENV = "QUORUMFL_HOME"


def default_home() -> Path:
    """The QuorumFL home: ``$QUORUMFL_HOME``, else ``~/.quorumfl`` (not created here)."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".quorumfl").expanduser()


def atomic_write(path: Path, payload: bytes, *, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class FileChangedError(OSError):
    """The file's size or modification time moved while it was read: another program is writing it."""


def read_unchanged(path: Path) -> bytes:
    """The whole file, read between two ``stat`` calls that must agree (size and mtime, and the bytes
    read must be the size): a department's export still being written is refused, not half-read.
    Raises ``FileChangedError``, or the ``OSError`` of the read."""
    before = path.stat()
    raw = path.read_bytes()
    after = path.stat()
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns) or len(raw) != after.st_size:
        raise FileChangedError(f"{path} changed while it was read")
    return raw
