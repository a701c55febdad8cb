"""The per-department ε ledger (local SQLite in the node's data directory)."""

from .store import LEDGER_FILE, Ledger, RunSpend

__all__ = ["LEDGER_FILE", "Ledger", "RunSpend"]
