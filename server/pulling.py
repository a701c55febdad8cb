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

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from flwr.app import Message
from flwr.serverapp import Grid

__all__ = ["ReplyPuller"]


class ReplyPuller:
    """One in-flight pull per waiting message id, on up to ``workers`` threads; use as a context manager."""

    def __init__(self, grid: Grid, *, workers: int = 8) -> None:
        self.grid = grid
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="quorumfl-pull")
        self._inflight: dict[str, Future[list[Message]]] = {}

    def poll(self, message_ids: Iterable[str]) -> list[Message]:
        """Start a pull for each id without one in flight; return the replies of the pulls that finished."""
        for mid in message_ids:
            if mid not in self._inflight:
                self._inflight[mid] = self._pool.submit(self._pull, mid)
        replies: list[Message] = []
        for mid in [m for m, f in self._inflight.items() if f.done()]:
            replies.extend(self._inflight.pop(mid).result())  # a failed pull raises here, as a direct call would
        return replies

    def _pull(self, message_id: str) -> list[Message]:
        return list(self.grid.pull_messages([message_id]))

    def __enter__(self) -> ReplyPuller:
        return self

    def __exit__(self, *_: object) -> None:
        self._inflight.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
