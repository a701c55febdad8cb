"""SIGTERM handled like Ctrl-C, so the clean-up of ``with`` blocks (child processes, the DB session)
runs for it too. Apart from ``processes`` so that the CLI's entry point imports no Flower module."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["terminate_on_signals"]


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so ``with ProcessGroup`` cleanup runs for it too."""

    def handler(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
