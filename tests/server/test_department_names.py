"""Department names come from the admin's roster, never from a node's own reply.

A signed federation: every node holds its department's registered key and the run carries the
roster. A node started under another department's name refuses to run; a node whose reply claims
another department (the signature is then not that department's) is recorded without a name, while
honest nodes get their roster names.
"""

from __future__ import annotations

import json
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord, Context, Message, RecordDict

from quorumfl.core.data import prepare_partitions
from quorumfl.protocol.wire import NODE

from .test_rounds import (
    LoopbackGrid,
    _federation,
    task_identity,  # noqa: F401  (an autouse fixture)
)

NAMES = ["tax-office", "urban-planning", "public-works"]


def signed_nodes(tmp_path: Path, started_as: dict[str, str] | None = None, *, names: list[str] = NAMES,
                 extra: dict[str, bool | int | float | str] | None = None) -> tuple[dict[int, Context], str]:
    """In-process nodes of a signed federation: each with its department's registered key, the run with
    the roster of those keys (returned too); ``extra``: node config every node adds."""
    parts = prepare_partitions(tmp_path / "data", names, seed=0, method="iid")
    lines, contexts = {}, {}
    for i, name in enumerate(names):
        key = ec.generate_private_key(ec.SECP384R1())
        path = tmp_path / f"{name}.key"
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        lines[name] = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                    serialization.PublicFormat.OpenSSH).decode()
        contexts[2000 + i] = (name, path)
    roster = json.dumps(lines)
    out = {
        node: Context(run_id=99, node_id=node, node_config={"data-path": str(parts[name]), "node-key": str(path),
                                                           "department": (started_as or {}).get(name, name),
                                                           **(extra or {})},
                      state=RecordDict(), run_config={"roster": roster})
        for node, (name, path) in contexts.items()
    }
    return out, roster


def test_a_reply_claiming_another_department_is_not_taken_and_honest_nodes_get_their_roster_names(
    tmp_path: Path,
) -> None:
    contexts, roster = signed_nodes(tmp_path)
    ids = list(contexts)

    def claim_tax_office(request: Message, reply: Message) -> Message:  # urban-planning's node says it is tax-office
        record = reply.content.config_records[NODE]
        content = RecordDict({**reply.content, NODE: ConfigRecord({
            "department": "tax-office", "department-signature": record["department-signature"]})})
        return Message(content=content, reply_to=request)

    grid = LoopbackGrid(contexts, {ids[1]: claim_tax_office}, fault_stages=("train", "evaluate"))
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 1, "roster": roster})
    federation.run()
    names = {n.node_id: n.department for n in repo.list_nodes()}
    assert names[ids[0]] == "tax-office" and names[ids[2]] == "public-works"
    assert names[ids[1]] != "tax-office"


def test_a_node_started_under_another_departments_name_refuses(tmp_path: Path) -> None:
    contexts, roster = signed_nodes(tmp_path, started_as={"public-works": "tax-office"})
    grid = LoopbackGrid(contexts)
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 1, "roster": roster})
    federation.run()
    [run] = repo.list_runs()
    [first] = repo.get_run(run.id).rounds
    impostor = list(contexts)[2]
    reasons = {f.node_id: f.reason for f in first.failures}
    assert "started as department 'tax-office' but its key is 'public-works'" in reasons[impostor]
    names = {n.node_id: n.department for n in repo.list_nodes()}
    assert [n for n, d in names.items() if d == "tax-office"] == [list(contexts)[0]]  # only the real one
