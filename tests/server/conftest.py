"""Fixtures shared by the server's round tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from quorumfl.core.data import prepare_partitions


@pytest.fixture
def six_parts(tmp_path: Path) -> dict[str, Path]:
    """Six department partitions of digits, label-skewed (Dirichlet 0.5)."""
    names = ["tax-office", "urban-planning", "public-works", "housing", "transport", "libraries"]
    return prepare_partitions(tmp_path / "data", names, seed=1, method="dirichlet", alpha=0.5)


@pytest.fixture
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's Message needs the task's identity that a ServerApp or ClientApp process has."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 7)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
