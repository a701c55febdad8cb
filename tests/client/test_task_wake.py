"""The SuperNode wakes its SuperExec after storing a message; only this user's wake-ups count."""

from __future__ import annotations

import importlib
import os
import socket
import time
from types import ModuleType
from typing import Any

import pytest
from flwr.supernode import start_client_internal

from quorumfl.deploy import task_wake
from quorumfl.deploy.supernode import wake_after_store
from quorumfl.deploy.task_wake import WAKE_ENV, WakeableSleep, Waker, new_wake_name


@pytest.fixture
def pair() -> Any:
    name = new_wake_name()
    sleeper = WakeableSleep(name)
    yield Waker(name), sleeper
    sleeper.close()


def test_a_wake_up_ends_the_wait(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    waker, sleeper = pair
    monkeypatch.setattr(task_wake, "FALLBACK_POLL_S", 3600.0)  # only a wake-up can end this wait
    waker.wake()
    waker.wake()
    sleeper.sleep(0.25)  # returns: the two queued wake-ups end one wait


def test_without_a_wake_up_the_fallback_ends_the_wait(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _waker, sleeper = pair
    monkeypatch.setattr(task_wake, "FALLBACK_POLL_S", 0.05)
    start = time.monotonic()
    sleeper.sleep(0.25)
    assert time.monotonic() - start >= 0.05


@pytest.mark.skipif(os.getuid() != 0, reason="sending as another user needs root to change user")
def test_wake_ups_from_another_user_are_ignored(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    waker, sleeper = pair
    pid = os.fork()
    if pid == 0:  # the other local user
        try:
            os.setgid(65534)
            os.setuid(65534)
            sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sender.setblocking(False)
            for _ in range(5):
                sender.sendto(b"w", waker.address)
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    monkeypatch.setattr(task_wake, "FALLBACK_POLL_S", 0.2)
    assert sleeper._drain() is False  # five datagrams arrived, none counts
    start = time.monotonic()
    sleeper.sleep(0.25)
    assert time.monotonic() - start >= 0.2  # so the wait ran to the fallback


def test_the_name_comes_only_from_the_environment_and_is_taken_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("", "other-name", "quorumfl-task-wake-" + "x" * 200, "quorumfl-task-wake-é"):
        monkeypatch.setenv(WAKE_ENV, bad)
        assert WakeableSleep.from_env() is None
    monkeypatch.setenv(WAKE_ENV, new_wake_name())
    first = WakeableSleep.from_env()
    assert first is not None
    try:
        assert WakeableSleep.from_env() is None  # a second SuperExec cannot take the same name
    finally:
        first.close()


def test_flowers_supernode_loop_is_woken_only_after_a_stored_message(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    waker, sleeper = pair
    # Flower 1.42's names this relies on: if an upgrade renames them, look again.
    assert callable(start_client_internal._pull_and_store_message)
    assert importlib.import_module("flwr.supercore.superexec.run_superexec").time is time
    answers = iter([None, 7])
    module = ModuleType("loop")
    module._pull_and_store_message = lambda **kwargs: next(answers)  # type: ignore[attr-defined]
    wake_after_store(module, waker)
    assert module._pull_and_store_message(state=None) is None  # type: ignore[attr-defined]
    assert sleeper._drain() is False  # nothing stored, nobody woken
    assert module._pull_and_store_message(state=None) == 7  # type: ignore[attr-defined]
    assert sleeper._drain() is True
