"""Baseline for ``threshold_ckks.py``: single-key homomorphic aggregation with TenSEAL, NVIDIA FLARE's approach.

Shipped inside a Flower app bundle by the benchmark (not part of the QuorumFL package). Every client
holds the same TenSEAL CKKS context *with* the secret key (provisioned beforehand: the benchmark
writes it to the file named by ``context-file``); the server holds only the public context
(``public-context-file``). A round: the server sends the encrypted aggregate of the previous round
(the initial model in plaintext in round 1); each client decrypts it into the global model, trains
with QuorumFL's own local training, and returns ``ts.ckks_vector`` of ``[w, w·θ]``; the server adds
the ciphertexts. One message round trip per round, and any client can decrypt any other client's
update — the trust model threshold CKKS removes. Parameters as FLARE's default: N = 8192,
coefficients [60, 40, 40], scale 2^40. Each round's wall time (send → encrypted sum ready) is
appended to the JSON-lines file ``timings-file``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()
POLL = 0.25  # as QuorumFL's ServerApp polls for replies


def _model(config: dict[str, Any]) -> Any:
    from quorumfl.core.models import build_model

    return build_model(str(config["model"]), (1, 8, 8), 10, seed=int(config["seed"]))


def _flat(model: Any) -> np.ndarray:
    return np.concatenate([v.detach().numpy().astype(np.float64).ravel() for v in model.state_dict().values()])


def _load(model: Any, flat: np.ndarray) -> None:
    import torch

    state, offset = {}, 0
    for key, value in model.state_dict().items():
        state[key] = torch.from_numpy(flat[offset: offset + value.numel()].reshape(value.shape).astype(np.float32))
        offset += value.numel()
    model.load_state_dict(state)


@server.main()
def main(grid: Grid, context: Context) -> None:
    import tenseal as ts

    config = dict(context.run_config)
    nodes = int(config["num-nodes"])
    deadline = time.monotonic() + 300
    while len(ids := list(grid.get_node_ids())) < nodes and time.monotonic() < deadline:
        time.sleep(1.0)
    public = ts.context_from(Path(str(config["public-context-file"])).read_bytes())
    initial = ArrayRecord({"model": Array(_flat(_model(config)))})
    aggregate: bytes | None = None
    timings = Path(str(config["timings-file"]))
    for rnd in range(1, int(config["num-rounds"]) + 1):
        start = time.perf_counter()
        body = initial if aggregate is None else ArrayRecord({"ct": Array(np.frombuffer(aggregate, dtype=np.uint8))})
        messages = [Message(content=RecordDict({"payload": body, "config": ConfigRecord({"round": rnd})}),
                            dst_node_id=n, message_type=MessageType.TRAIN) for n in ids]
        waiting = set(grid.push_messages(messages))
        total = None
        stop = time.monotonic() + float(config["round-timeout"])
        while waiting and time.monotonic() < stop:
            for reply in grid.pull_messages(list(waiting)):
                waiting.discard(reply.metadata.reply_to_message_id)
                if reply.has_error():
                    raise RuntimeError(f"node error: {reply.error.reason}")
                raw = reply.content.array_records["encrypted"]["ct"].numpy().tobytes()
                vector = ts.ckks_vector_from(public, raw)
                total = vector if total is None else total + vector
            if waiting:
                time.sleep(POLL)
        if waiting or total is None:
            raise RuntimeError(f"round {rnd}: {len(waiting)} node(s) did not answer")
        aggregate = total.serialize()
        with timings.open("a") as out:
            out.write(json.dumps({"round_s": time.perf_counter() - start}) + "\n")


@client.train()
def train(msg: Message, context: Context) -> Message:
    import tenseal as ts
    import torch

    from quorumfl.core.data.store import read_partition
    from quorumfl.training.local import train as local_train

    run = dict(context.run_config)
    secret = ts.context_from(Path(str(run["context-file"])).read_bytes())
    torch.set_num_threads(1)
    model = _model(run)
    payload = msg.content.array_records["payload"]
    if "model" in payload:
        flat = payload["model"].numpy()
    else:  # any client decrypts the whole aggregate: that is the single-key trust model
        total = np.array(ts.ckks_vector_from(secret, payload["ct"].numpy().tobytes()).decrypt())
        flat = total[1:] / total[0]
    _load(model, flat)
    part = read_partition(Path(str(context.node_config["data-path"])))
    result = local_train(model, part.train, epochs=int(run["local-epochs"]), batch_size=int(run["batch-size"]),
                         learning_rate=float(run["learning-rate"]), seed=int(run["seed"]))
    w = min(result.num_examples, 10000.0) / 10000.0
    vector = ts.ckks_vector(secret, np.concatenate([[w], w * _flat(model)]).tolist())
    reply = ArrayRecord({"ct": Array(np.frombuffer(vector.serialize(), dtype=np.uint8))})
    return Message(content=RecordDict({"encrypted": reply}), reply_to=msg)
