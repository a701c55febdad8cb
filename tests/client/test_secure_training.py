"""The subtract-two-sums attack on secure rounds, played against the real node (``client.steps``).

A server that gets one department to train from the same global model twice, with participant
sets that differ in that department, learns its update as the difference of the two revealed sums —
exactly, if training is deterministic (seed = run seed + round, both the server's). The node now
refuses the second set (its contribution ledger), and its secure-round training draws its own
entropy, so even a repeat with the same set does not reproduce the update.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

from quorumfl.aggregation.ckks import CkksParams
from quorumfl.aggregation.secagg import NodeEpoch
from quorumfl.aggregation.secagg.messages import EpochAnnouncement, MaskingParams, MaskRequest
from quorumfl.client.steps import train_received
from quorumfl.core.data import prepare_partitions
from quorumfl.core.models import build_model, model_to_arrays
from quorumfl.errors import SecureAggregationError
from quorumfl.privacy.contributions import CONTRIBUTIONS_FILE
from quorumfl.protocol.ckks_wire import CKKS, TrainRequest, encode_train_request
from quorumfl.protocol.secure_wire import SECAGG, encode_mask_request
from quorumfl.protocol.wire import ARRAYS, CONFIG, TrainConfig, to_array_record

from ..server.test_rounds import task_identity  # noqa: F401  (an autouse fixture)

A = (11, 12, 13, 14)
B = (11, 12, 13)  # the same departments but one: their sums differ by that department's update
CONFIG_1 = TrainConfig(server_round=3, model="mlp", local_epochs=1, batch_size=32, learning_rate=0.05,
                       proximal_mu=0.0, seed=0)


EPOCH = b"e" * 16


def _with_epoch(context: Context) -> Context:
    """The node holds the keys of the key epoch the masked requests name (an unsigned one)."""
    state, _ = NodeEpoch.advertise(EpochAnnouncement(EPOCH, A, MaskingParams(threshold=3, slots=4)), 11)
    context.state.config_records["secagg-epoch"] = ConfigRecord({"state": state.to_bytes()})
    return context


@pytest.fixture
def node(tmp_path: Path) -> Context:
    [part] = prepare_partitions(tmp_path / "data", ["tax-office"], seed=0, method="iid").values()
    return _with_epoch(Context(run_id=5, node_id=11, node_config={"data-path": str(part),
                                                                  "state-dir": str(tmp_path / "state")},
                               state=RecordDict(), run_config={}))


def _global() -> dict[str, np.ndarray]:
    return model_to_arrays(build_model("mlp", (1, 8, 8), 10, seed=1))


def _request(group: tuple[int, ...] | None, *, ckks: bool = False) -> Message:
    content = RecordDict({ARRAYS: to_array_record(_global()), CONFIG: CONFIG_1.to_record()})
    if group is not None and not ckks:
        content[SECAGG] = encode_mask_request(MaskRequest(EPOCH, 0, group), max_weight=1e4)
    if group is not None and ckks:
        content[CKKS] = encode_train_request(TrainRequest(
            key_id="0" * 32, public_key=b"", params=CkksParams(), primes=2, clip=8.0, max_weight=1e4, round_number=3,
            participants=group, nonce=b"n" * 16))
    return Message(content=content, dst_node_id=11, message_type="train")


def _update(node: Context, request: Message) -> dict[str, np.ndarray]:
    local = train_received(request, node)
    return {k: np.asarray(local.trained[k]) - np.asarray(local.received[k]) for k in local.trained}


def test_deterministic_training_would_hand_the_server_the_update_and_the_node_now_refuses(node: Context) -> None:
    # What the attack relied on: with the run's seed, the same request trains the same update bit for bit,
    # so sum(A) − sum(B) is this department's update exactly.
    repeat = _with_epoch(Context(run_id=5, node_id=11, node_config={**node.node_config, "reproducible-training": True},
                                 state=RecordDict(), run_config={}))
    first, again = _update(repeat, _request(A)), _update(repeat, _request(A))
    assert all(np.array_equal(first[k], again[k]) for k in first)
    # The attack: the same model, a participant set without one department.
    with pytest.raises(SecureAggregationError, match="another set .* subtract the two sums"):
        train_received(_request(B), repeat)
    with pytest.raises(SecureAggregationError, match="subtract the two sums"):  # a CKKS round from that model too
        train_received(_request(B, ckks=True), repeat)


def test_secure_rounds_train_from_the_nodes_own_entropy_and_plaintext_rounds_do_not(node: Context) -> None:
    first, again = _update(node, _request(A)), _update(node, _request(A))  # a repeat with the same set is admitted
    assert not all(np.array_equal(first[k], again[k]) for k in first)
    plain, plain_again = _update(node, _request(None)), _update(node, _request(None))
    assert all(np.array_equal(plain[k], plain_again[k]) for k in plain)  # the run's seed, as before
    ledger = json.loads((Path(str(node.node_config["state-dir"])) / CONTRIBUTIONS_FILE).read_text())
    assert [entry["participants"] for entry in ledger.values()] == [[str(n) for n in A]]  # plaintext is not recorded


def test_an_unreadable_ledger_fails_closed(node: Context) -> None:
    path = Path(str(node.node_config["state-dir"])) / CONTRIBUTIONS_FILE
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(SecureAggregationError, match="contribution ledger .* is unreadable"):
        train_received(_request(A), node)
    assert path.read_text() == "{not json"  # left as it was for the department to restore


def test_a_node_without_the_epochs_keys_refuses_before_training_or_recording(tmp_path: Path) -> None:
    [part] = prepare_partitions(tmp_path / "data", ["tax-office"], seed=0, method="iid").values()
    restarted = Context(run_id=5, node_id=11, node_config={"data-path": str(part), "state-dir": str(tmp_path / "state")},
                        state=RecordDict(), run_config={})  # a SuperNode restarted: its keys are gone
    with pytest.raises(SecureAggregationError, match="holds no secure-aggregation keys"):
        train_received(_request(A), restarted)
    assert not (tmp_path / "state" / CONTRIBUTIONS_FILE).exists()  # nothing recorded: it could not have masked
