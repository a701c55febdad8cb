"""The department's privacy ledger tables (SQLAlchemy 2 typed ORM; schema by Alembic migrations)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, Float, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = ["Base", "NoisePlan", "Refusal", "Spend"]


class Base(DeclarativeBase):
    pass


class Spend(Base):
    """One round of DP-SGD on the department's data: the mechanism as the accountant sees it."""

    __tablename__ = "privacy_spend"
    __table_args__ = (UniqueConstraint("run", "round", name="uq_spend_run_round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run: Mapped[str] = mapped_column(String(128), index=True)
    round: Mapped[int] = mapped_column(Integer)
    noise_multiplier: Mapped[float] = mapped_column(Float)
    sample_rate: Mapped[float] = mapped_column(Float)
    steps: Mapped[int] = mapped_column(Integer)
    delta: Mapped[float] = mapped_column(Float)
    epsilon_total: Mapped[float] = mapped_column(Float)  # the department's ε over every entry so far
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Refusal(Base):
    """A round the node refused because it would have taken the department past its budget."""

    __tablename__ = "privacy_refusals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run: Mapped[str] = mapped_column(String(128), index=True)
    round: Mapped[int] = mapped_column(Integer)
    epsilon_would_be: Mapped[float] = mapped_column(Float)
    budget: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class NoisePlan(Base):
    """A noise multiplier found for a target ε (a binary search of PRV evaluations: seconds), kept so
    the next round of the run reads it back; checked against its target each time it is read."""

    __tablename__ = "privacy_noise_plans"
    __table_args__ = (UniqueConstraint("target_epsilon", "delta", "sample_rate", "steps", name="uq_noise_plan"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    target_epsilon: Mapped[float] = mapped_column(Float)
    delta: Mapped[float] = mapped_column(Float)
    sample_rate: Mapped[float] = mapped_column(Float)
    steps: Mapped[int] = mapped_column(Integer)
    noise_multiplier: Mapped[float] = mapped_column(Float)
