"""The per-department ε ledger: a SQLite file in the node's data directory, migrated by Alembic.

Before a DP round the node asks ``reserve``: the department's ε over every recorded round plus the
planned one, composed by the PRV accountant (``privacy.accounting``). Above the budget the round is
refused (``PrivacyBudgetError``) and the refusal recorded; otherwise the round's spend is written
*before* training starts, so a crash after noise was drawn can never leave spending unrecorded
(fail closed). A round asked again (a resumed crash) is not charged twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from quorumfl.errors import ConfigError, PrivacyBudgetError, StateError
from quorumfl.privacy import accounting
from quorumfl.privacy.accounting import Entry, epsilon
from quorumfl.privacy.ledger.orm import NoisePlan, Refusal, Spend

__all__ = ["LEDGER_FILE", "Ledger", "RunSpend"]

LEDGER_FILE = "privacy-ledger.db"
MIGRATIONS = Path(__file__).parent / "migrations"


@dataclass(frozen=True)
class RunSpend:
    run: str
    rounds: int
    epsilon: float  # this run's entries alone


def _pragmas(dbapi_conn: object, _record: object) -> None:
    cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


class Ledger:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def open(cls, data_dir: Path) -> Ledger:
        """The ledger of the department whose partition is ``data_dir`` (created and migrated on first use)."""
        if not data_dir.is_dir():
            raise ConfigError(f"--data {data_dir} is not a directory; give the department's partition directory")
        engine = create_engine(f"sqlite:///{data_dir / LEDGER_FILE}", connect_args={"timeout": 30})
        event.listen(engine, "connect", _pragmas)
        config = Config()
        config.set_main_option("script_location", str(MIGRATIONS))
        config.attributes["engine"] = engine
        try:
            command.upgrade(config, "head")
        except SQLAlchemyError as exc:
            raise StateError(f"privacy ledger {data_dir / LEDGER_FILE} cannot be opened: {exc}") from exc
        return cls(engine)

    def _session(self) -> Session:
        return self._sessions()

    def spends(self) -> list[Spend]:
        with self._session() as s:
            return list(s.scalars(select(Spend).order_by(Spend.id)))

    def refusals(self) -> list[Refusal]:
        with self._session() as s:
            return list(s.scalars(select(Refusal).order_by(Refusal.id)))

    @staticmethod
    def _entries(spends: list[Spend]) -> list[Entry]:
        return [(s.noise_multiplier, s.sample_rate, s.steps) for s in spends]

    def spent(self, delta: float) -> float:
        """The department's ε at ``delta`` over every recorded round of every run."""
        return epsilon(self._entries(self.spends()), delta)

    def by_run(self, delta: float) -> list[RunSpend]:
        runs: dict[str, list[Spend]] = {}
        for spend in self.spends():
            runs.setdefault(spend.run, []).append(spend)
        return [RunSpend(run, len(items), epsilon(self._entries(items), delta)) for run, items in runs.items()]

    def noise_for_target(self, target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
        """``accounting.noise_for_target``, found once per schedule and read back after that.

        Every round of a run plans the same σ, and each round runs in a fresh ClientApp process, so
        without this each would repeat the binary search (seconds). A stored σ is used only if one
        accountant evaluation confirms its schedule stays within the target (fail closed: an edited
        row is searched again and replaced)."""
        key = (float(target_epsilon), float(delta), float(sample_rate), int(steps))
        with self._session() as s:
            stored = s.scalars(select(NoisePlan).where(
                NoisePlan.target_epsilon == key[0], NoisePlan.delta == key[1], NoisePlan.sample_rate == key[2],
                NoisePlan.steps == key[3])).first()
        if stored is not None and stored.noise_multiplier > 0 and \
                epsilon([(stored.noise_multiplier, key[2], key[3])], key[1]) <= key[0]:
            return float(stored.noise_multiplier)
        sigma = accounting.noise_for_target(*key)
        try:
            with self._session() as s, s.begin():
                if stored is not None:
                    s.get_one(NoisePlan, stored.id).noise_multiplier = sigma
                else:
                    s.add(NoisePlan(target_epsilon=key[0], delta=key[1], sample_rate=key[2], steps=key[3],
                                    noise_multiplier=sigma))
        except IntegrityError:
            pass  # another process of this node stored the same plan first; σ is the same
        return sigma

    def reserve(self, run: str, round_number: int, entry: Entry, *, delta: float, budget: float) -> float:
        """Record the round's spend and return the department's new total ε, or refuse (and record why)."""
        if not budget > 0:
            raise ConfigError(f"dp-budget must be > 0, got {budget}")
        refusal: Refusal | None = None
        with self._session() as s, s.begin():
            spends = list(s.scalars(select(Spend).order_by(Spend.id)))
            for spend in spends:
                if (spend.run, spend.round) == (run, round_number):
                    if (spend.noise_multiplier, spend.sample_rate, spend.steps) != tuple(entry):
                        raise PrivacyBudgetError(f"run {run} round {round_number} was already charged with a "
                                                 "different schedule; refusing to train it again")
                    return spend.epsilon_total  # the same round asked again: already charged
            total = epsilon([*self._entries(spends), entry], delta)
            now = datetime.now(UTC)
            if total > budget:
                reason = (f"round {round_number} of run {run} would bring this department to ε = {total:.3f} "
                          f"(δ = {delta:g}), over its budget of {budget:g}; raise the node's dp-budget or use a "
                          "larger dp-noise-multiplier / smaller dp-epsilon")
                refusal = Refusal(run=run, round=round_number, epsilon_would_be=total, budget=budget, reason=reason,
                                  created_at=now)
                s.add(refusal)
            else:
                s.add(Spend(run=run, round=round_number, noise_multiplier=float(entry[0]),
                            sample_rate=float(entry[1]), steps=int(entry[2]), delta=delta, epsilon_total=total,
                            created_at=now))
        if refusal is not None:
            raise PrivacyBudgetError(refusal.reason)
        return total
