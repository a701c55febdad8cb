"""Differential privacy, privacy accounting and key-material handling (filled by later work)."""
