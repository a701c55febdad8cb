"""The department's ε ledger: charges, refusals, no double charge, survives reopening; Opacus agrees."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from quorumfl.errors import ConfigError, PrivacyBudgetError
from quorumfl.privacy import accounting
from quorumfl.privacy.accounting import epsilon
from quorumfl.privacy.ledger import LEDGER_FILE, Ledger

ROUND = (1.0, 0.02, 100)


def test_reserve_until_the_budget_then_refuse(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path)
    one = ledger.reserve("7", 1, ROUND, delta=1e-5, budget=5.0)
    two = ledger.reserve("7", 2, ROUND, delta=1e-5, budget=5.0)
    assert one == pytest.approx(epsilon([ROUND], 1e-5)) and two == pytest.approx(epsilon([ROUND] * 2, 1e-5))
    assert ledger.reserve("7", 2, ROUND, delta=1e-5, budget=5.0) == two  # asked again: not charged twice
    with pytest.raises(PrivacyBudgetError, match="different schedule"):
        ledger.reserve("7", 2, (2.0, 0.02, 100), delta=1e-5, budget=5.0)

    budget = two * 1.01  # room for nothing more
    with pytest.raises(PrivacyBudgetError, match="over its budget") as err:
        ledger.reserve("8", 1, ROUND, delta=1e-5, budget=budget)
    assert "dp-budget" in str(err.value)
    # The refusal is recorded; the spends are untouched; reopening the file gives the same state.
    again = Ledger.open(tmp_path)
    assert [(s.run, s.round) for s in again.spends()] == [("7", 1), ("7", 2)]
    assert [(r.run, r.round) for r in again.refusals()] == [("8", 1)]
    assert again.spent(1e-5) == pytest.approx(two)
    assert [(r.run, r.rounds) for r in again.by_run(1e-5)] == [("7", 2)]


def test_spends_of_several_runs_compose(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path)
    ledger.reserve("a", 1, ROUND, delta=1e-5, budget=50)
    ledger.reserve("b", 1, (0.8, 0.05, 30), delta=1e-5, budget=50)
    assert ledger.spent(1e-5) == pytest.approx(epsilon([ROUND, (0.8, 0.05, 30)], 1e-5))
    runs = {r.run: r.epsilon for r in ledger.by_run(1e-5)}
    assert runs["a"] == pytest.approx(epsilon([ROUND], 1e-5))
    assert ledger.spent(1e-5) < runs["a"] + runs["b"]  # PRV composition is tighter than adding ε's


def test_schema_is_migrated_and_bad_input_named(tmp_path: Path) -> None:
    Ledger.open(tmp_path)
    with sqlite3.connect(tmp_path / LEDGER_FILE) as db:
        tables = {r[0] for r in db.execute("select name from sqlite_master where type='table'")}
    assert {"privacy_spend", "privacy_refusals", "privacy_noise_plans", "privacy_ledger_version"} <= tables
    with pytest.raises(ConfigError, match="not a directory"):
        Ledger.open(tmp_path / "missing")
    with pytest.raises(ConfigError, match="dp-budget"):
        Ledger.open(tmp_path).reserve("7", 1, ROUND, delta=1e-5, budget=0)


def test_noise_plans_are_found_once_and_checked_when_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    searches: list[tuple[float, float, float, int]] = []
    search = accounting.noise_for_target

    def counted(*key: float) -> float:
        searches.append(key)  # type: ignore[arg-type]
        return search(*key)  # type: ignore[arg-type]

    monkeypatch.setattr(accounting, "noise_for_target", counted)
    key = (3.0, 1e-5, 1 / 47, 470)
    sigma = Ledger.open(tmp_path).noise_for_target(*key)
    assert sigma == search(*key) and len(searches) == 1
    # A later round runs in a fresh process: it reads the plan back without searching.
    assert Ledger.open(tmp_path).noise_for_target(*key) == sigma and len(searches) == 1
    assert Ledger.open(tmp_path).noise_for_target(3.0, 1e-5, 1 / 47, 940) > sigma and len(searches) == 2
    # Fail closed: a stored σ too small for its target is not used; it is searched again and replaced.
    with sqlite3.connect(tmp_path / LEDGER_FILE) as db:
        db.execute("update privacy_noise_plans set noise_multiplier = 0.3 where steps = 470")
    assert Ledger.open(tmp_path).noise_for_target(*key) == sigma and len(searches) == 3
    assert Ledger.open(tmp_path).noise_for_target(*key) == sigma and len(searches) == 3
    assert epsilon([(sigma, 1 / 47, 470)], 1e-5) <= 3.0


def test_a_ledger_of_the_first_schema_keeps_its_spends(tmp_path: Path) -> None:
    """A department's ledger written before noise plans existed upgrades in place; nothing is lost."""
    from alembic import command
    from alembic.config import Config
    from sqlalchemy import create_engine

    from quorumfl.privacy.ledger.store import MIGRATIONS

    engine = create_engine(f"sqlite:///{tmp_path / LEDGER_FILE}")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["engine"] = engine
    command.upgrade(config, "0001_privacy_ledger")
    with sqlite3.connect(tmp_path / LEDGER_FILE) as db:
        db.execute("insert into privacy_spend (run, round, noise_multiplier, sample_rate, steps, delta, epsilon_total, "
                   "created_at) values ('7', 1, 1.1, 0.02, 50, 1e-5, 0.5, '2026-11-29 00:00:00')")
    engine.dispose()
    ledger = Ledger.open(tmp_path)
    assert [(s.run, s.round, s.noise_multiplier) for s in ledger.spends()] == [("7", 1, 1.1)]
    assert ledger.spent(1e-5) == pytest.approx(epsilon([(1.1, 0.02, 50)], 1e-5))
    assert ledger.noise_for_target(3.0, 1e-5, 0.02, 50) > 0
