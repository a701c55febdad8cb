"""The runs a department's node has served: an admin-signed run is good for one Flower run only.

The admin's signature over a run's bundle (``privacy.admin``) covers its run config, and that config
carries a fresh ``run-nonce``, an expiry (``run-expires``, Unix seconds) and the version of the roster
it was signed with (``roster-version``, which grows with every node key added or retired:
``deploy.certs.roster_version``). Before a node lets a run's app load, ``ServedRuns.admit`` checks:

- the nonce was never admitted for another Flower run on this node: the same signed bytes sent
  again (a replay with a stolen Control token, or by the server itself) are refused;
- a run this node has not served yet is not past its expiry: a signed run must start within its
  window (``privacy.admin.SIGNED_RUN_VALID_S``); once admitted, the run's later tasks continue past it;
- its roster is not older than the newest roster this node has seen in a signed run: after a
  department's key is retired, an old signed run (whose roster still lists that key) is refused.

A later task of an admitted run (same nonce, same Flower run id) is admitted again. The ledger is a
JSON file in the node's state directory, read and written under an exclusive file lock (a node's
ClientApp tasks run in several processes) and written atomically; it fails closed when unreadable.
Written by hand: it is a few lines over a file, and no library keeps a nonce ledger on a node.
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from quorumfl.core.files import atomic_write
from quorumfl.errors import CredentialError
from quorumfl.privacy.admin import RUN_STAMP_KEYS

__all__ = ["SERVED_RUNS_FILE", "ServedRuns", "SignedRun"]

SERVED_RUNS_FILE = "served-runs.json"
KEEP = 100_000  # nonces kept; an evicted nonce's run is long past its expiry (oldest expiry first)


class SignedRun:
    """The freshness fields of a signed run config, read strictly (a missing or malformed one refuses)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        nonce, expires, version = (config.get(k) for k in RUN_STAMP_KEYS)
        if not isinstance(nonce, str) or len(nonce) != 32 or any(c not in "0123456789abcdef" for c in nonce):
            raise CredentialError("the signed run config has no run nonce (32 hex digits): it was signed without "
                                  "one, so it could be sent again; the admin signs it again ('quorumfl runs start')")
        self.nonce = nonce
        self.expires, self.roster_version = (_count(key, value) for key, value in zip(RUN_STAMP_KEYS[1:],
                                                                                      (expires, version), strict=True))


def _count(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CredentialError(f"the signed run config's {key} must be a whole number >= 0, got {value!r}")
    return value


class ServedRuns:
    """The file ``SERVED_RUNS_FILE`` in a node's state directory."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / SERVED_RUNS_FILE

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield self._load()

    def _load(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"runs": {}, "roster-version": 0}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("runs"), dict) \
                    or not isinstance(data.get("roster-version"), int):
                raise ValueError("expected {'runs': {...}, 'roster-version': N}")
        except (OSError, ValueError) as exc:  # fail closed: an unreadable ledger admits nothing
            raise CredentialError(f"the node's ledger of served runs {self.path} is unreadable ({exc}); restore it "
                                  "from a backup before this node runs anything again") from exc
        return data

    def admit(self, run: SignedRun, *, run_id: int, now: float) -> None:
        """Admit a task of Flower run ``run_id`` signed as ``run``; raise ``CredentialError`` with the
        reason for a replay, an expired run or an older roster (module docstring)."""
        with self._locked() as data:
            served = data["runs"].get(run.nonce)
            if served is not None:
                if served.get("run") != run_id:
                    raise CredentialError(f"this signed run was already served as run {served.get('run')}; the same "
                                          f"signature sent again as run {run_id} is a replay and is refused")
                return
            if now > run.expires:
                raise CredentialError(f"this signed run expired {now - run.expires:.0f} s ago and this node has not "
                                      "served it; the admin signs a new one ('quorumfl runs start')")
            if run.roster_version < data["roster-version"]:
                raise CredentialError(f"this signed run carries roster version {run.roster_version}, older than the "
                                      f"version {data['roster-version']} this node has seen: a key on it may have been "
                                      "revoked since; the admin signs a new run")
            data["runs"][run.nonce] = {"run": run_id, "expires": run.expires}
            data["roster-version"] = max(data["roster-version"], run.roster_version)
            if len(data["runs"]) > KEEP:
                for old in sorted(data["runs"], key=lambda k: data["runs"][k]["expires"])[: len(data["runs"]) - KEEP]:
                    del data["runs"][old]
            atomic_write(self.path, json.dumps(data, sort_keys=True).encode(), mode=0o600)
