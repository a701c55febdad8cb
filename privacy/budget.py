"""A department's total ε over all runs: the default a node keeps when its config sets no ``dp-budget``.

Declared here, apart from the ledger and the accountant, so that the node, the search planner and
the CLI read one value without importing SQLAlchemy or Opacus.
"""

from __future__ import annotations

__all__ = ["DEFAULT_DP_BUDGET"]

DEFAULT_DP_BUDGET = 10.0
