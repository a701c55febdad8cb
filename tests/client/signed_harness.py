"""Department nodes of a signed federation for the node-handler tests: each node's key on disk and a
Flower Context carrying the admin-signed run config, as a deployed ClientApp sees it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import Context, RecordDict


def roster_json(keys: Mapping[str, ec.EllipticCurvePrivateKey]) -> str:
    return json.dumps({name: key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                           serialization.PublicFormat.OpenSSH).decode()
                       for name, key in keys.items()})


def department_contexts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: Sequence[int],
                        keys: Mapping[str, ec.EllipticCurvePrivateKey], run_config: Mapping[str, object], *,
                        key_store: bool = False) -> dict[int, Context]:
    """One Context per node (in ``keys``' order), its key written under ``tmp_path``; ``key_store``:
    each node also keeps CKKS key shares there. Sets the task identity Flower's Message needs."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 7)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    out = {}
    for node, (name, key) in zip(nodes, keys.items(), strict=True):
        path = tmp_path / f"{name}.key"
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
        node_config: dict[str, str | int | float | bool | bytes] = {"node-key": str(path), "department": name}
        if key_store:
            node_config["key-dir"] = str(tmp_path / name)
        out[node] = Context(run_id=7, node_id=node, node_config=node_config, state=RecordDict(),
                            run_config=dict(run_config))  # type: ignore[arg-type]
    return out
