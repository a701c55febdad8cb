"""The per-department ε ledger (local SQLite in the node's data directory)."""

from quorumfl.privacy.ledger.store import LEDGER_FILE, Ledger, RunSpend

__all__ = ["LEDGER_FILE", "Ledger", "RunSpend"]
