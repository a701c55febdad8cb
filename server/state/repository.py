"""The repository: every read and write of QuorumFL state goes through here, one transaction each.

``Repository`` is the records of each aggregate put together, one module each: runs
(``runs.py``), rounds (``rounds.py``), CKKS key ceremonies and decryptions (``ceremonies.py``), nodes
(``nodes.py``), metrics (``metrics.py``), model versions (``versions.py``), client selection
(``selection.py``), hyper-parameter search trials (``trials.py``) and totals for the metrics endpoint (``totals.py``); transactions and status values are in ``access.py``.
"""

from __future__ import annotations

from quorumfl.server.state.access import (
    INTERRUPTED,
    STOPPED_BY_ADMIN,
    CeremonyStatus,
    RoundStatus,
    RunStatus,
    read,
    utcnow,
    write,
)
from quorumfl.server.state.ceremonies import KeyRecords
from quorumfl.server.state.metrics import MetricRecords
from quorumfl.server.state.nodes import NodeRecords
from quorumfl.server.state.rounds import RoundRecords
from quorumfl.server.state.selection import SelectionRecords
from quorumfl.server.state.totals import TotalRecords
from quorumfl.server.state.trials import TrialRecords
from quorumfl.server.state.versions import ModelRecords

__all__ = [
    "INTERRUPTED", "STOPPED_BY_ADMIN", "CeremonyStatus", "Repository", "RoundStatus", "RunStatus", "read", "utcnow", "write",
]


class Repository(RoundRecords, KeyRecords, NodeRecords, MetricRecords, ModelRecords, SelectionRecords, TotalRecords,
                 TrialRecords):
    """Typed access to runs, rounds, CKKS ceremonies, nodes, metrics, model versions, selection and
    search trials, and totals over all of them."""
