"""Flower's object pulls retry after 0.05 s (doubling to 1 s) once ``shorten_pull_backoff`` ran."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from flwr.supercore.constant import PULL_BACKOFF_CAP, PULL_INITIAL_BACKOFF
from flwr.supercore.inflatable import inflatable_utils
from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError, pull_objects

from quorumfl.protocol.pull_backoff import BACKOFF_CAP_S, INITIAL_BACKOFF_S, shorten_pull_backoff


@pytest.fixture
def restored() -> Any:
    saved = [dict(f.__kwdefaults__ or {}) for f in (pull_objects, inflatable_utils.pull_and_inflate_object_from_tree)]
    yield
    for f, kw in zip((pull_objects, inflatable_utils.pull_and_inflate_object_from_tree), saved, strict=True):
        f.__kwdefaults__ = kw


def _waits_while_pulling(monkeypatch: pytest.MonkeyPatch, unavailable: int) -> list[float]:
    """Run Flower's pull_objects on an object that is missing ``unavailable`` times; the waits it asked for."""
    waits: list[float] = []
    monkeypatch.setattr(inflatable_utils.random, "uniform", lambda a, b: 0.0)  # no jitter
    real_wait = threading.Event.wait

    def recording_wait(self: threading.Event, timeout: float | None = None) -> bool:
        if timeout is not None:
            waits.append(timeout)
        return real_wait(self, 0)
    monkeypatch.setattr(threading.Event, "wait", recording_wait)
    misses = {"n": 0}

    def pull(object_id: str) -> bytes:
        if misses["n"] < unavailable:
            misses["n"] += 1
            raise ObjectUnavailableError(object_id)
        return b"content"
    assert pull_objects(["object-1"], pull) == {"object-1": b"content"}
    return waits


def test_flowers_own_backoff_starts_at_one_second(restored: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference: what Flower 1.42's own constants do (so the test below shows a real difference),
    whatever another test in this process already set."""
    for function in (pull_objects, inflatable_utils.pull_and_inflate_object_from_tree):
        assert function.__kwdefaults__ is not None
        function.__kwdefaults__.update(initial_backoff=PULL_INITIAL_BACKOFF, backoff_cap=PULL_BACKOFF_CAP)
    assert _waits_while_pulling(monkeypatch, 3) == [1, 2, 4]


def test_shortened_backoff_retries_after_50_ms_doubling_to_the_cap(restored: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    shorten_pull_backoff()
    waits = _waits_while_pulling(monkeypatch, 7)
    assert waits == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert (INITIAL_BACKOFF_S, BACKOFF_CAP_S) == (0.05, 1.0)
    kw = inflatable_utils.pull_and_inflate_object_from_tree.__kwdefaults__ or {}
    assert (kw["initial_backoff"], kw["backoff_cap"]) == (0.05, 1.0)
    assert kw["max_tries_per_object"] == 500  # Flower's own limits stay
