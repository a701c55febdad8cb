"""Exit codes of the ``quorumfl`` command and the one-red-line error reporting.

| code | meaning |
|------|---------|
| 0    | success |
| 1    | other QuorumFL error |
| 2    | wrong command-line usage (Typer) |
| 3    | invalid configuration or argument (ConfigError) |
| 4    | data missing or unreadable (DataError) |
| 5    | run / node / model version not found (NotFoundError) |
| 6    | state database unreachable or not migrated (StateError) |
| 7    | model file missing or tampered (ModelStoreError) |
| 8    | Flower federation failed or unreachable (FederationError) |
| 9    | model or aggregation error (ModelError, AggregationError) |
| 10   | edge artifact refused or sync failed (ArtifactError); other edge errors (EdgeError) |
| 11   | TLS or node credentials missing, invalid or expired (CredentialError) |
| 12   | the run ended with some rounds failed: status ``partial`` (RoundsLostError) |
| 13   | a department's privacy budget would be passed (PrivacyBudgetError) |
| 130  | interrupted (Ctrl-C) |
"""

from __future__ import annotations

from quorumfl.errors import (
    AggregationError,
    ArtifactError,
    ConfigError,
    CredentialError,
    DataError,
    EdgeError,
    FederationError,
    ModelError,
    ModelStoreError,
    NotFoundError,
    PrivacyBudgetError,
    QuorumError,
    RoundsLostError,
    StateError,
)

__all__ = ["EXIT_CODES", "exit_code"]

# Most specific first.
EXIT_CODES: list[tuple[type[QuorumError], int]] = [
    (ConfigError, 3),
    (DataError, 4),
    (NotFoundError, 5),
    (StateError, 6),
    (RoundsLostError, 12),
    (ModelStoreError, 7),
    (FederationError, 8),
    (ModelError, 9),
    (AggregationError, 9),
    (ArtifactError, 10),
    (EdgeError, 10),
    (CredentialError, 11),
    (PrivacyBudgetError, 13),
]


def exit_code(error: QuorumError) -> int:
    for kind, code in EXIT_CODES:
        if isinstance(error, kind):
            return code
    return 1
