"""Differential privacy, privacy accounting, the ε ledger and key-material handling."""
