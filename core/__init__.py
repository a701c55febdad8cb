"""Shared by every role: atomic files and home folders, models, departments' data."""
