"""Whether joining paid: each department's federated model against the model it trained alone.

Each node reports ``alone-<metric>`` at the end of a run (``quorumfl.client.alone``): its own model,
trained on its own data only with the same budget. Beside it the department's figure for what the
federation gave it: the best of the federation's model for it (global, or its cluster's), its
personal model (FedPer, Ditto) and the federation's model fine-tuned on its data (``tuned-<metric>``,
``quorumfl.client.tuned``), since each is the department's to use. ``gain-vs-alone`` is that
figure's advantage (positive: the federation did better; for MAE, the error it saved), and
``joining-paid`` says "yes" where the gain is positive and "no" where it is not (a tie included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from quorumfl.core.metric_names import higher_is_better

__all__ = ["GAIN", "VERDICT", "alone_sentence", "compare_alone"]

GAIN = "gain-vs-alone"
VERDICT = "joining-paid"


def compare_alone(rows: Sequence[dict[str, Any]], primary: str) -> list[dict[str, Any]]:
    """``rows`` (one per department, as ``department_finals`` makes them) with ``gain-vs-alone`` and
    ``joining-paid`` ("yes"/"no") where the department reported its alone model's figure."""
    higher = higher_is_better(primary)
    out = []
    for row in rows:
        row = dict(row)
        alone = row.get(f"alone-{primary}")
        ours = _ours(row, primary)
        if alone is not None and ours:
            best = max(ours) if higher else min(ours)
            row[GAIN] = best - alone if higher else alone - best
            row[VERDICT] = "yes" if row[GAIN] > 0 else "no"
        out.append(row)
    return out


def alone_sentence(rows: Sequence[dict[str, Any]], primary: str) -> str | None:
    """One line on whether joining paid, naming the departments better off alone; None where no
    department reported an alone model (``local-baseline = false``, or a run before it existed)."""
    compared = [r for r in rows if VERDICT in r]
    if not compared:
        return None
    alone = [r for r in compared if r[VERDICT] == "no"]
    head = (f"Joining paid for {len(compared) - len(alone)} of {len(compared)} departments: their {primary} with "
            f"the federation's model against a model each trained alone on its own data with the same budget")
    if not alone:
        return head + "."
    names = ", ".join(f"{r['department']} ({primary} {_figure(r, primary)})" for r in alone)
    return f"{head}. It did not pay for: {names}."


def _ours(row: dict[str, Any], primary: str) -> list[float]:
    """The department's figures for what the federation gave it: global (or cluster), personal, tuned."""
    return [v for v in (row.get(primary), row.get(f"personal-{primary}"), row.get(f"tuned-{primary}")) if v is not None]


def _figure(row: dict[str, Any], primary: str) -> str:
    ours = _ours(row, primary)
    best = max(ours) if higher_is_better(primary) else min(ours)
    return f"{best:.4g} federated vs {row[f'alone-{primary}']:.4g} alone"
