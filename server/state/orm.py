"""SQLAlchemy 2 typed ORM: runs, rounds, round failures, nodes, metrics, model versions, heads,
key ceremonies and threshold decryptions (the audit trail of who could decrypt what), and client
selection (each selector's learned state, and what it chose each round with its reward), the
signed edge artifacts made from promoted model versions, and the trials of hyper-parameter searches.

The schema is created and changed only by the Alembic migrations in ``migrations/``; a test checks
that the migrations and these classes agree.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from quorumfl.server.state.types import UInt64

__all__ = [
    "Base",
    "Decryption",
    "EdgeArtifact",
    "KeyCeremony",
    "Metric",
    "ModelHead",
    "ModelVersion",
    "Node",
    "Round",
    "RoundFailure",
    "Run",
    "SearchTrial",
    "SelectionRecord",
    "SelectorState",
    "UInt64",
]

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    flower_run_id: Mapped[int | None] = mapped_column(UInt64, unique=True)
    status: Mapped[str] = mapped_column(String(16))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    strategy: Mapped[str] = mapped_column(String(32))
    num_rounds: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    rounds: Mapped[list[Round]] = relationship(
        back_populates="run", order_by="(Round.number, Round.attempt)", cascade="all, delete-orphan"
    )


class Round(Base):
    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("run_id", "number", "attempt", name="uq_rounds_run_number_attempt"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    # A round interrupted (server crash, stop) stays recorded as aborted; its redo is attempt + 1.
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    status: Mapped[str] = mapped_column(String(16))
    selected: Mapped[list[int]] = mapped_column(JSON)
    participants: Mapped[list[int]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Seconds per phase: "train" (send → last reply), "aggregate", "evaluate", "store".
    timings: Mapped[dict[str, float]] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    # While running: the stage under way and its nodes (see ``Repository.set_round_progress``).
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)

    run: Mapped[Run] = relationship(back_populates="rounds")
    failures: Mapped[list[RoundFailure]] = relationship(
        back_populates="round", cascade="all, delete-orphan", order_by="RoundFailure.id"
    )


class RoundFailure(Base):
    __tablename__ = "round_failures"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id", ondelete="CASCADE"), index=True)
    node_id: Mapped[int] = mapped_column(UInt64)
    stage: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    round: Mapped[Round] = relationship(back_populates="failures")


class Node(Base):
    __tablename__ = "nodes"

    node_id: Mapped[int] = mapped_column(UInt64, primary_key=True, autoincrement=False)
    department: Mapped[str | None] = mapped_column(String(64), index=True)
    enabled: Mapped[bool] = mapped_column(default=True)
    first_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # registered or first seen
    last_seen: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # None: registered, not yet seen


class Metric(Base):
    __tablename__ = "metrics"
    __table_args__ = (Index("ix_metrics_run_round", "run_id", "round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    round: Mapped[int] = mapped_column(Integer)
    # NULL node_id = a global (server-side or aggregated) metric.
    node_id: Mapped[int | None] = mapped_column(UInt64)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float] = mapped_column(Float)


class ModelVersion(Base):
    __tablename__ = "model_versions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), index=True)
    round: Mapped[int] = mapped_column(Integer)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("model_versions.id"))
    architecture: Mapped[str] = mapped_column(String(128), index=True)
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    metrics: Mapped[dict[str, float]] = mapped_column(JSON)
    tags: Mapped[list[str]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ModelHead(Base):
    """The version that the next round (or run) of an architecture starts from."""

    __tablename__ = "model_heads"

    architecture: Mapped[str] = mapped_column(String(128), primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id"))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class KeyCeremony(Base):
    """A threshold-CKKS key ceremony of a run: requested by the admin or started by the server."""

    __tablename__ = "key_ceremonies"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(16))  # requested | running | complete | failed
    key_id: Mapped[str | None] = mapped_column(String(32))
    threshold: Mapped[int | None] = mapped_column(Integer)
    members: Mapped[list[int]] = mapped_column(JSON)
    holders: Mapped[list[int]] = mapped_column(JSON)
    params: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    requested_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Decryption(Base):
    """One threshold decryption of a round's aggregate: the key, the contributors, the subset S."""

    __tablename__ = "decryptions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id", ondelete="CASCADE"), index=True)
    key_id: Mapped[str] = mapped_column(String(32))
    contributors: Mapped[list[int]] = mapped_column(JSON)
    decryptors: Mapped[list[int]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))  # requested | complete | failed
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class SelectorState(Base):
    """A client selector's learned state (node statistics; the RL agent's weights, optimiser and
    guard), kept under a key that outlives runs, so a restarted server continues from it."""

    __tablename__ = "selector_states"

    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    rounds: Mapped[int] = mapped_column(Integer)  # rounds it has learned from
    state: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class SelectionRecord(Base):
    """What a run's selector chose in one round (nodes and their local epochs), which policy chose
    it (``rl`` or its ``oort`` fallback, ``random``…), and the reward the round earned."""

    __tablename__ = "selection_records"
    __table_args__ = (UniqueConstraint("run_id", "round", name="uq_selection_records_run_round"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    round: Mapped[int] = mapped_column(Integer)
    policy: Mapped[str] = mapped_column(String(16))
    choices: Mapped[list[list[int]]] = mapped_column(JSON)  # [[node id, local epochs], …] in choice order
    outcomes: Mapped[dict[str, str]] = mapped_column(JSON)  # node id -> ok | late | failed
    reward: Mapped[float] = mapped_column(Float)
    details: Mapped[dict[str, float]] = mapped_column(JSON)  # the guard's averages, round seconds…
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class EdgeArtifact(Base):
    """A signed INT8 artifact for edge devices: one format of one promotion of a model version.

    ``manifest`` is the exact signed byte string (canonical JSON); the columns repeat its fields for
    queries. Artifacts are never updated in place (a new promotion gets the next version), except for
    ``signature``, which a rotation of the signing key replaces with the new key's.
    """

    __tablename__ = "edge_artifacts"
    __table_args__ = (UniqueConstraint("version", "format", name="uq_edge_artifacts_version_format"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer, index=True)
    channel: Mapped[str] = mapped_column(String(16), index=True)
    format: Mapped[str] = mapped_column(String(8))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    signature: Mapped[str] = mapped_column(String(128))  # Ed25519, hex
    manifest: Mapped[str] = mapped_column(Text)
    model_version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id"), index=True)
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class SearchTrial(Base):
    """One trial of a hyper-parameter search (``quorumfl tune``): the run-config values it tried, the
    run that tried them, each round's federated figure and the final one. ``state``: running,
    complete, pruned (stopped by the pruner after a round) or failed."""

    __tablename__ = "search_trials"
    __table_args__ = (UniqueConstraint("study", "number", name="uq_search_trials_study_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    study: Mapped[str] = mapped_column(String(64), index=True)
    number: Mapped[int] = mapped_column(Integer)  # 0, 1, … within the study
    state: Mapped[str] = mapped_column(String(16))
    params: Mapped[dict[str, Any]] = mapped_column(JSON)  # run-config key -> value tried
    space: Mapped[dict[str, Any]] = mapped_column(JSON)  # run-config key -> its search dimension
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), index=True)
    metric: Mapped[str | None] = mapped_column(String(64))  # the figure's name, e.g. federated-accuracy
    higher_is_better: Mapped[bool] = mapped_column(default=True)
    figures: Mapped[dict[str, float]] = mapped_column(JSON)  # round number (as text) -> that round's figure
    value: Mapped[float | None] = mapped_column(Float)  # the final model's figure (complete trials)
    # what the sampler and pruner noted on the trial (Optuna's system attributes, e.g. the pruner's
    # rungs it passed), so that a continued study samples and prunes as one search
    notes: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
