"""The SuperExec hands ClientApp tasks to the warm server from a thread (no launch-gate process),
with the same arguments Flower would give ``flwr-clientapp`` and the same fallbacks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from flwr.supercore.constant import TaskType
from flwr.supercore.superexec.executor import subprocess_executor
from flwr.supercore.superexec.executor.types import ExecutionSpec

from quorumfl.deploy.launch_gate import (
    GATE_WAIT_ENV,
    SLOTS_DIR_ENV,
    SLOTS_ENV,
    WARM_ENV,
    acquire_slot,
)
from quorumfl.deploy.warm import _launch_in_thread, _task_argv, install_warm_launch


def _spec(**changes: Any) -> ExecutionSpec:
    fields: dict[str, Any] = {"task_type": TaskType.CLIENT_APP, "runtime_api_address": "127.0.0.1:9", "token": "t0k",
                              "insecure": False, "root_certificates_path": "/certs/ca.crt",
                              "runtime_dependency_install": False, "parent_pid": 4242, "suppress_output": True,
                              "task_id": 7}
    fields.update(changes)
    return ExecutionSpec(**fields)


@pytest.mark.parametrize("changes", [{}, {"insecure": True, "root_certificates_path": None},
                                     {"parent_pid": None, "runtime_dependency_install": True}])
def test_the_task_gets_the_arguments_flower_would_give_it(monkeypatch: pytest.MonkeyPatch,
                                                          changes: dict[str, Any]) -> None:
    started: list[list[str]] = []
    monkeypatch.setattr(subprocess_executor.subprocess, "Popen", lambda args, **kw: started.append(list(args)))
    spec = _spec(**changes)
    subprocess_executor.SubprocessExecutor().launch(spec)  # Flower's own launch, recorded
    assert started == [["flwr-clientapp", *_task_argv(spec)]]


def test_install_replaces_only_flowers_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    executor = subprocess_executor.SubprocessExecutor
    monkeypatch.setattr(executor, "launch", executor.launch)  # restored after the test
    assert install_warm_launch() is True
    assert install_warm_launch() is False  # a launch that is not Flower's own is left alone


def test_an_unreachable_warm_server_falls_back_to_flowers_launch(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(WARM_ENV, str(blocker / "warm.sock"))  # its folder cannot be made: no server
    monkeypatch.delenv(SLOTS_ENV, raising=False)
    cold: list[bool] = []
    _launch_in_thread(_spec(), lambda: cold.append(True))
    assert cold == [True]


def test_without_a_free_host_slot_nothing_starts_and_the_slot_rule_holds(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    monkeypatch.setenv(SLOTS_ENV, "1")
    monkeypatch.setenv(SLOTS_DIR_ENV, str(slots))
    monkeypatch.setenv(GATE_WAIT_ENV, "0.3")
    monkeypatch.setenv(WARM_ENV, str(tmp_path / "file-not-dir" / "x" / "warm.sock"))
    held = acquire_slot(slots, 1, timeout=1)
    assert held is not None
    cold: list[bool] = []
    try:
        _launch_in_thread(_spec(), lambda: cold.append(True))
        assert cold == []  # as the gate's exit 75: Flower starts the task again once its claim lapses
    finally:
        os.close(held[0])
    (tmp_path / "file-not-dir").write_text("")  # the warm server's folder cannot be made now
    _launch_in_thread(_spec(), lambda: cold.append(True))
    assert cold == [True]  # with the slot free, the cold path runs (and got the slot back first)
    again = acquire_slot(slots, 1, timeout=1)
    assert again is not None  # nothing kept the slot
    os.close(again[0])


@pytest.mark.parametrize("wait", ["abc", "0", "5000"])
def test_a_bad_slot_wait_goes_to_the_gate_that_refuses_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           wait: str) -> None:
    monkeypatch.setenv(SLOTS_ENV, "1")
    monkeypatch.setenv(SLOTS_DIR_ENV, str(tmp_path / "slots"))
    monkeypatch.setenv(GATE_WAIT_ENV, wait)
    monkeypatch.setenv(WARM_ENV, str(tmp_path / "warm.sock"))
    cold: list[bool] = []
    _launch_in_thread(_spec(), lambda: cold.append(True))
    assert cold == [True]  # Flower's launch: the gate names the variable and exits 78
    assert not (tmp_path / "warm.sock").exists()  # no warm server was started for it
