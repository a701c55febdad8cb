"""The one QuorumFL error tree.

It is the lowest layer of the package structure (docs/explanation/architecture.md): it imports nothing of
QuorumFL's, and every other layer raises from it::

    QuorumError
    ├── ConfigError          bad run/federation config or CLI argument (names the key and the fix)
    ├── DataError            missing/corrupt dataset or partition directory
    ├── ModelError           unknown model name, architecture mismatch
    ├── AggregationError     an update that cannot be combined (names the node and the problem)
    │   ├── EmptyAggregationError   nothing left to aggregate
    │   └── SecureAggregationError  a secure-aggregation message breaks the protocol (fails closed)
    │       └── QuorumNotMetError   fewer than t parties are left; nothing is revealed
    ├── StateError           the state database (unreachable, not migrated, missing row)
    │   ├── NotFoundError    a run / node / model version that does not exist
    │   └── RunStoppedError  the run was stopped while its server was still running it (no new round)
    ├── ModelStoreError      a model file missing, tampered or unreadable
    ├── TrainingError        local training failed (a DDP worker died, a checkpoint is unusable)
    ├── PrivacyBudgetError   the next round would spend more ε than the department allows (refused)
    ├── SelectionError       a client selector broke its contract, or its stored state is unusable
    ├── EdgeError            quantisation/export of an edge model failed
    │   └── ArtifactError    an edge artifact failed its hash or signature, or its sync broke off (fails closed)
    ├── CredentialError      TLS or node-authentication material missing, unreadable, expired or mismatched
    └── FederationError      the Flower SuperLink/SuperNodes (unreachable, failed to start, run failed)
        └── RoundsLostError  the run ended, but some of its rounds failed (its status is ``partial``)

The CLI maps each branch to a documented exit code (see ``quorumfl.cli.errors``).
"""

from __future__ import annotations

__all__ = [
    "AggregationError",
    "ArtifactError",
    "EdgeError",
    "ConfigError",
    "CredentialError",
    "DataError",
    "EmptyAggregationError",
    "FederationError",
    "ModelError",
    "ModelStoreError",
    "NotFoundError",
    "QuorumError",
    "QuorumNotMetError",
    "RoundsLostError",
    "RunStoppedError",
    "SecureAggregationError",
    "PrivacyBudgetError",
    "SelectionError",
    "StateError",
    "TrainingError",
]


class QuorumError(Exception):
    """Base of every error QuorumFL raises on purpose."""


class ConfigError(QuorumError):
    """A configuration value is missing or invalid; the message names the key and the fix."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class DataError(QuorumError):
    """A dataset or a department's partition directory is missing or unreadable."""


class ModelError(QuorumError):
    """Unknown model name or parameters that do not fit the model."""


class AggregationError(QuorumError):
    """An update cannot be combined; ``node`` names the department node it came from."""

    def __init__(self, message: str, *, node: str | None = None) -> None:
        self.node = node
        super().__init__(f"node {node}: {message}" if node is not None else message)


class EmptyAggregationError(AggregationError):
    """No valid update is left to aggregate."""


class SecureAggregationError(AggregationError):
    """A secure-aggregation stage received something the protocol does not allow; the stage refuses it."""


class QuorumNotMetError(SecureAggregationError):
    """Fewer than the threshold of parties remain, so the protocol stops before revealing anything."""


class StateError(QuorumError):
    """The state database cannot be used (unreachable, not migrated, inconsistent)."""


class NotFoundError(StateError):
    """A run, node or model version that does not exist."""


class RunStoppedError(StateError):
    """The run is no longer running (an admin stopped it) while its ServerApp still was: no new round."""


class ModelStoreError(QuorumError):
    """A stored model file is missing, does not match its recorded SHA-256, or cannot be read."""


class FederationError(QuorumError):
    """The Flower federation (SuperLink, SuperNodes, Control API) failed or is unreachable."""


class RoundsLostError(FederationError):
    """A run ended with some of its rounds failed: its model is what the completed rounds made, and
    its status is ``partial`` (``quorumfl rounds list`` says why each failed)."""


class TrainingError(QuorumError):
    """Local training could not finish: a DDP worker failed, or a checkpoint could not be used."""


class PrivacyBudgetError(QuorumError):
    """Training would take a department past its privacy budget; the node refuses (fails closed)."""


class SelectionError(QuorumError):
    """A client selector chose outside the available nodes or the round's count, or its saved state
    (agent weights, node statistics) cannot be restored."""


class EdgeError(QuorumError):
    """An edge model could not be quantised, exported or run (names the step and the fix)."""


class ArtifactError(EdgeError):
    """An edge artifact is refused: its hash, size or Ed25519 signature does not verify, its version
    is not newer than the installed one, or its download broke off. The installed model is kept."""


class CredentialError(QuorumError):
    """TLS certificates or SuperNode keys are missing, unreadable, expired or do not belong together;
    nothing starts without them unless ``--insecure`` is asked for explicitly (fails closed)."""
