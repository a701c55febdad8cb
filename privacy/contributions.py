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

One exception keeps a federation live after a round that failed before anything was revealed (too
few masked inputs, say): in a signed masking epoch nothing is unmasked before the survivors consent,
by confirming the round's view or, in a round with no dropout (no consistency stage), by answering
its unmask request, and a node records here (``confirm``) that it consents to a slot before its
signature or its shares leave. A contribution whose slot this node never consented to is *released*
when the node is asked to train from the same model with another set: the old slot goes on the
entry's ``released`` list and ``confirm`` refuses it from then on, so this node never consents to
that input being unmasked.
CKKS contributions and unsigned masking epochs (no consistency stage) keep the strict rule.

Fresh local entropy (``client.steps``) makes two contributions from the same model and set differ
too, so a repeat with the same set reveals no difference of one update either. What remains
(docs/explanation/security.md): the ledger keys on the exact model, so an active server can evade it by
changing the model slightly, and it can unmask a sum without this node's consent (the others'
shares, and in a consistency stage their signatures, suffice); a set the server names but does not complete (a department "dropping out" of
the repeat) still changes the sum by that department's update plus the others' training noise;
and sums over different models (successive rounds) leak what FedAvg's trajectory leaks. Against
those, the fresh entropy and differential privacy are what protect a department.

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

from quorumfl.core.files import atomic_write
from quorumfl.errors import SecureAggregationError

__all__ = ["CONTRIBUTIONS_FILE", "ContributionLedger", "model_digest", "slot_key"]

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

    def _save(self, entries: dict[str, Any]) -> None:
        if len(entries) > KEEP:
            for old in sorted(entries, key=lambda k: str(entries[k].get("at", "")))[: len(entries) - KEEP]:
                del entries[old]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, json.dumps(entries, sort_keys=True).encode(), mode=0o600)

    def admit(self, digest: str, participants: Sequence[int], *, run: str, round_number: int, slot: str = "") -> None:
        """Record the first participant set for ``digest``; refuse a different one later, unless every
        earlier contribution from it went into a signed masking slot this node never confirmed (those
        slots are then released for good).

        ``slot`` names the signed masking slot this contribution goes into (``slot_key``), or is empty
        (CKKS, an unsigned epoch: no consistency stage, so nothing can be released).
        """
        members = [str(m) for m in sorted({int(p) for p in participants})]
        entries = self._load()
        previous = entries.get(digest)
        released: list[str] = []
        if previous is not None:
            slots = [str(s) for s in previous.get("slots", [])]
            if previous.get("participants") == members:  # a repeat with the same set: admitted, slot added
                if slot and slot not in slots:
                    previous["slots"] = [*slots, slot]
                    self._save(entries)
                return
            if previous.get("confirmed") or not slots:
                why = ("this node confirmed that round's survivors, so its sum may have been revealed"
                       if previous.get("confirmed") else "that contribution cannot be withdrawn")
                raise SecureAggregationError(
                    f"this node already trained from model {digest[:12]} under secure aggregation with "
                    f"{len(previous.get('participants', []))} other participant(s) (run {previous.get('run')} round "
                    f"{previous.get('round')}; {why}); a contribution with another set ({len(members)}) would let the "
                    "server subtract the two sums, so it is refused. To go on, train from another model: a run "
                    "with start-from = 'fresh' and a new seed, or one from the head after another round completes; "
                    "or redo the round with the same departments")
            released = [*previous.get("released", []), *slots]  # never confirmed: never to be unmasked
        entries[digest] = {"participants": members, "run": run, "round": round_number,
                           "at": datetime.now(UTC).isoformat(timespec="seconds"), "slots": [slot] if slot else [],
                           "released": released, "confirmed": False}
        self._save(entries)

    def confirm(self, slot: str) -> None:
        """Before this node signs the view of ``slot``: record that the contribution in it may now be
        unmasked; refuse a slot that was released (or that holds no contribution of this node)."""
        entries = self._load()
        if any(slot in entry.get("released", []) for entry in entries.values()):
            raise SecureAggregationError(
                "this node trained again from the same model with another participant set after that round, "
                "releasing its input of the round; it will never confirm it (nothing revealed)")
        for entry in entries.values():
            if slot in entry.get("slots", []):
                if not entry.get("confirmed"):
                    entry["confirmed"] = True
                    self._save(entries)
                return
        raise SecureAggregationError("this node's contribution ledger has no input of it for that round; "
                                     "refusing to confirm (nothing revealed)")


def slot_key(epoch: bytes, slot: int) -> str:
    """How the ledger names a signed masking slot."""
    return f"{epoch.hex()}:{int(slot)}"
