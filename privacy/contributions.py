"""What a node contributed under secure aggregation: one participant set per model it trained from.

The attack this stops: secure aggregation reveals only sums, but a server that gets a department
to train from the same global model twice — a "failed" round redone, a resumed run, a new run
from the same model version — with participant sets that differ in one department can subtract
the two revealed sums and get that department's update. Before a node trains in a masked or
threshold-CKKS round it asks ``admit``: the first time a model (by SHA-256 of the arrays it
received) is trained from, the participant set the server named (the node's masking group, or
the CKKS round's participants) is recorded; later requests from the same model are admitted only
with the same set, anything else is refused with the reason. The entry is on disk before training
starts, so a crash can only make the node refuse more.

Fresh local entropy (``client.steps``) makes two contributions from the same model and set differ
too, so a repeat with the same set reveals no difference of one update either. What remains
(README "Security"): a set the server names but does not complete (a department "dropping out" of
the repeat) still changes the sum by that department's update plus the others' training noise;
and sums over different models (successive rounds) leak what FedAvg's trajectory leaks.

A JSON file written atomically; a node keeps the last ``KEEP`` models.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from quorumfl.aggregation.errors import SecureAggregationError
from quorumfl.client.files import atomic_write

__all__ = ["CONTRIBUTIONS_FILE", "ContributionLedger", "model_digest"]

CONTRIBUTIONS_FILE = "secure-contributions.json"
KEEP = 10_000


def model_digest(models: Iterable[Mapping[str, NDArray[np.generic]]]) -> str:
    """SHA-256 over every received model's arrays (names, dtypes, shapes, bytes), in order."""
    digest = hashlib.sha256(b"quorumfl/received-models-v1")
    for arrays in models:
        for name in sorted(arrays):
            value = np.ascontiguousarray(arrays[name])
            digest.update(name.encode() + b"\0" + str(value.dtype).encode() + str(value.shape).encode())
            digest.update(value.tobytes())
        digest.update(b"\1")
    return digest.hexdigest()


class ContributionLedger:
    """The file ``CONTRIBUTIONS_FILE`` in a node's state directory."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / CONTRIBUTIONS_FILE

    def _load(self) -> dict[str, Any]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
                raise ValueError("expected an object of objects")
        except (OSError, ValueError) as exc:  # fail closed: never train on as if nothing had been contributed
            raise SecureAggregationError(f"the node's contribution ledger {self.path} is unreadable ({exc}); restore "
                                         "it from a backup before this node takes part in secure rounds again") from exc
        return data

    def admit(self, digest: str, participants: Sequence[int], *, run: str, round_number: int) -> None:
        """Record the first participant set for ``digest``; refuse a different one later."""
        members = sorted({int(p) for p in participants})
        entries = self._load()
        previous = entries.get(digest)
        if previous is not None:
            if previous.get("participants") != [str(m) for m in members]:
                raise SecureAggregationError(
                    f"this node already trained from model {digest[:12]} under secure aggregation with "
                    f"{len(previous.get('participants', []))} other participant(s) (run {previous.get('run')} round "
                    f"{previous.get('round')}); a contribution with another set ({len(members)}) would let the server "
                    "subtract the two sums, so it is refused")
            return
        entries[digest] = {"participants": [str(m) for m in members], "run": run, "round": round_number,
                           "at": datetime.now(UTC).isoformat(timespec="seconds")}
        if len(entries) > KEEP:
            for old in sorted(entries, key=lambda k: str(entries[k].get("at", "")))[: len(entries) - KEEP]:
                del entries[old]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(entries, sort_keys=True).encode(), mode=0o600)
