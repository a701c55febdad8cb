"""Pulling replies from the SuperLink without letting one slow upload hold up a round.

Flower 1.42 registers a reply as soon as a node starts sending it and then uploads its arrays as
separate objects; ``Grid.pull_messages`` returns the reply only after it has pulled every object,
retrying for up to two hours. A department on a slow link therefore blocks the call that pulls
its reply, and every other reply pulled in the same call, far past the round's deadline. Flower
has no non-blocking pull, so ``ReplyPuller`` pulls one message id per call on a few worker threads:
a reply still uploading occupies one worker, the others keep arriving, and the caller stops
waiting at its deadline. A pull abandoned at the deadline finishes on its thread and is dropped
(its node was already recorded late); at most ``workers`` replies are held in memory at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future

from flwr.app import Message
from flwr.serverapp import Grid

__all__ = ["ReplyPuller"]


class ReplyPuller:
    """One in-flight pull per waiting message id, at most ``workers`` at once; use as a context manager.

    Pulls run on daemon threads: one abandoned at the deadline (a node that died half-way through
    its upload keeps Flower retrying for up to two hours) must not keep the ServerApp process from
    exiting when the run is over.
    """

    def __init__(self, grid: Grid, *, workers: int = 8) -> None:
        self.grid = grid
        self.workers = max(1, workers)
        self._inflight: dict[str, Future[list[Message]]] = {}

    def poll(self, message_ids: Iterable[str]) -> list[Message]:
        """Start a pull for each id without one in flight (while fewer than ``workers`` are); return
        the replies of the pulls that finished."""
        for mid in message_ids:
            if mid not in self._inflight and len(self._inflight) < self.workers:
                future: Future[list[Message]] = Future()
                threading.Thread(target=self._pull, args=(mid, future), daemon=True, name="quorumfl-pull").start()
                self._inflight[mid] = future
        replies: list[Message] = []
        for mid in [m for m, f in self._inflight.items() if f.done()]:
            replies.extend(self._inflight.pop(mid).result())  # a failed pull raises here, as a direct call would
        return replies

    def _pull(self, message_id: str, future: Future[list[Message]]) -> None:
        try:
            future.set_result(list(self.grid.pull_messages([message_id])))
        except BaseException as exc:  # handed to the caller by ``poll``
            future.set_exception(exc)

    def __enter__(self) -> ReplyPuller:
        return self

    def __exit__(self, *_: object) -> None:
        self._inflight.clear()  # pulls still running finish on their own threads; their replies are dropped
