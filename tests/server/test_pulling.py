"""ReplyPuller: a pull that blocks (a reply still uploading) holds up neither the other replies nor
the caller, and is abandoned without waiting when the caller is done."""

from __future__ import annotations

import threading
import time

import pytest

from quorumfl.server.pulling import ReplyPuller


class BlockingGrid:
    """``pull_messages([id])`` returns ``["reply-" + id]``; the id ``slow`` blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[list[str]] = []

    def pull_messages(self, message_ids: list[str]) -> list[str]:
        self.calls.append(list(message_ids))
        if message_ids == ["slow"]:
            self.release.wait(30)
        return [f"reply-{m}" for m in message_ids]


def test_a_blocked_pull_holds_up_neither_the_others_nor_the_caller() -> None:
    grid = BlockingGrid()
    got: list[str] = []
    started = time.monotonic()
    with ReplyPuller(grid, workers=4) as puller:  # type: ignore[arg-type]
        while len(got) < 3 and time.monotonic() - started < 10:
            got += puller.poll(["a", "b", "slow", "c"])  # type: ignore[arg-type]
            time.sleep(0.01)
    assert sorted(got) == ["reply-a", "reply-b", "reply-c"]
    assert time.monotonic() - started < 5  # it never waited for the blocked pull
    assert all(len(call) == 1 for call in grid.calls)  # one id per call
    grid.release.set()


def test_at_most_workers_pulls_run_at_once_and_errors_reach_the_caller() -> None:
    grid = BlockingGrid()
    with ReplyPuller(grid, workers=1) as puller:  # type: ignore[arg-type]
        assert puller.poll(["slow", "a"]) == []  # type: ignore[arg-type]
        time.sleep(0.1)
        assert grid.calls == [["slow"]]  # "a" waits for the one worker
        grid.release.set()
        deadline = time.monotonic() + 5
        got: list[str] = []
        while len(got) < 2 and time.monotonic() < deadline:
            got += puller.poll(["slow", "a"] if not got else ["a"])  # type: ignore[arg-type]
            time.sleep(0.01)
        assert got == ["reply-slow", "reply-a"]

    class Failing:
        def pull_messages(self, _ids: list[str]) -> list[str]:
            raise ConnectionError("SuperLink unreachable")

    with ReplyPuller(Failing()) as puller, pytest.raises(ConnectionError, match="unreachable"):  # type: ignore[arg-type]
        for _ in range(500):
            puller.poll(["x"])  # type: ignore[arg-type]
            time.sleep(0.01)
