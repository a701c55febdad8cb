"""TensorBoard scalars of a run, written by the ServerApp as its rounds complete (run config
``tensorboard-dir``): one folder ``run-ID`` per run, the same series as ``quorumfl runs report``.

Each round's values are taken from ``report.report_data`` (the state DB the round has just been
written to), so TensorBoard, the HTML report and ``--format json`` show one set of numbers. Tags,
with the round number as the step:

- ``metric/<name>``: every global figure of the round (the task's metric and loss, the federated
  ones, train loss, participants, examples, bytes down, server peak RSS, per-cluster metrics);
- ``stage-seconds/<stage>``: the round's time per stage;
- ``bytes/up`` and ``bytes/down``: arrays the departments sent, and the server sent;
- ``participation/<state>``: how many selected nodes trained, were late, rejected, refused or dropped;
- ``epsilon/<department>``: ε its ledger reported after the round (DP runs).

At the end of the run, ``final/<department>/<name>`` holds each department's final-model metrics, and
``final/final-federated-<name>`` their example-weighted mean.
The writer is torch's ``SummaryWriter`` (TensorBoard's own event format).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from quorumfl.server.report import PARTICIPATION, report_data
from quorumfl.server.rounds import Federation
from quorumfl.server.state.repository import Repository, RoundStatus

__all__ = ["RoundHook", "TensorBoardSink", "final_scalars", "round_scalars", "run_observed"]

RoundHook = Callable[[int, int, dict[str, float]], None]  # (run id, round number, the round's metrics)


def round_scalars(data: dict[str, Any], number: int) -> dict[str, float]:
    """The scalars of round ``number`` (its last completed attempt) from ``report_data``'s dict."""
    rounds = [r for r in data["rounds"] if r["round"] == number and r["status"] == RoundStatus.COMPLETED]
    if not rounds:
        return {}
    rnd = rounds[-1]
    scalars = {f"metric/{k}": float(v) for k, v in rnd["metrics"].items()}
    scalars.update({f"stage-seconds/{k}": float(v) for k, v in rnd["stages_s"].items()})
    if rnd["uplink_bytes"] is not None:
        scalars["bytes/up"] = float(rnd["uplink_bytes"])
    if rnd["downlink_bytes"] is not None:
        scalars["bytes/down"] = float(rnd["downlink_bytes"])
    states = [row.get(str(number)) for row in data["participation"]["nodes"].values()]
    scalars.update({f"participation/{s}": float(states.count(s)) for s in PARTICIPATION})
    scalars.update({f"epsilon/{p['department']}": float(p["epsilon"]) for p in data["privacy"] if p["round"] == number})
    return scalars


def final_scalars(data: dict[str, Any]) -> dict[str, float]:
    """Each department's final-model metrics (its alone model's and the gain over it among them),
    ``final/<department>/<name>``, and their example-weighted means, ``final/final-federated-<name>``."""
    return {**{f"final/{row['department']}/{k}": float(v) for row in data["departments"]
               for k, v in row.items() if isinstance(v, (int, float)) and k != "node_id"},
            **{f"final/{name}": float(v) for name, v in data["final"].items()}}


class TensorBoardSink:
    """Writes each completed round's scalars, and the final ones at ``close``; a ``Federation.run``
    ``on_round`` callback."""

    def __init__(self, root: Path, repo: Repository) -> None:
        self.root = root
        self.repo = repo
        self.run_id: int | None = None
        self.writer: Any = None

    def on_round(self, run_id: int, number: int, _metrics: dict[str, float]) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.run_id = run_id
            self.writer = SummaryWriter(log_dir=str(self.root / f"run-{run_id}"))
        for tag, value in round_scalars(report_data(self.repo, run_id), number).items():
            self.writer.add_scalar(tag, value, global_step=number)
        self.writer.flush()

    def close(self) -> None:
        """Write the departments' final metrics and close the event file."""
        if self.writer is None or self.run_id is None:
            return
        data = report_data(self.repo, self.run_id)
        step = max((r["round"] for r in data["rounds"]), default=0)
        for tag, value in final_scalars(data).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.close()
        self.writer = None


def run_observed(federation: Federation, on_round: RoundHook | None = None) -> int:
    """``federation.run()`` with the run config's observers: TensorBoard scalars when ``tensorboard-dir``
    is set (the event file is closed whether the run completes or fails), and ``on_round``."""
    folder = federation.config.tensorboard_dir
    if not folder:
        return federation.run(on_round=on_round)
    sink = TensorBoardSink(Path(folder).expanduser(), federation.repo)

    def both(run_id: int, number: int, metrics: dict[str, float]) -> None:
        sink.on_round(run_id, number, metrics)
        if on_round is not None:
            on_round(run_id, number, metrics)

    try:
        return federation.run(on_round=both)
    finally:
        sink.close()
