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
