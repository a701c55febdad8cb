"""Masked rounds through the federation loop and the real ClientApp handlers (in-process Grid).

The masked result is compared with the same run in plaintext mode: same seeds, same data, so the
only difference allowed is the fixed-point error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, RecordDict

from quorumfl.errors import FederationError
from quorumfl.privacy.keystore import KeyStore
from quorumfl.protocol.ckks_wire import ENCRYPTED
from quorumfl.protocol.secure_wire import ADVERTISE, MASKED, SHARE, UNMASK
from quorumfl.protocol.wire import ARRAYS
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.repository import RoundStatus, RunStatus

from .test_rounds import (
    REPRODUCIBLE,
    LoopbackGrid,
    _contexts,
    _federation,
    silent,
    task_identity,  # noqa: F401  (an autouse fixture)
    withheld_as_crashed,
)

SECURE = {"secure-aggregation": "masking", "secagg-threshold": 0.6}


def _models(repo: object, run_id: int) -> list[dict[str, np.ndarray]]:
    return [ModelStore.load(v.path, v.sha256) for v in repo.list_model_versions(run_id=run_id)]  # type: ignore[attr-defined]


def test_masked_rounds_equal_plaintext_fedavg(tmp_path: Path, six_parts: dict[str, Path]) -> None:
    plain_fed, repo = _federation(tmp_path, LoopbackGrid(_contexts(six_parts, REPRODUCIBLE)))
    plain_models = _models(repo, plain_fed.run())

    grid = LoopbackGrid(_contexts(six_parts, REPRODUCIBLE))
    secure_fed, repo = _federation(tmp_path, grid, **SECURE)
    run_id = secure_fed.run()

    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    for plain, masked in zip(plain_models, _models(repo, run_id), strict=True):
        for key in plain:
            np.testing.assert_allclose(masked[key], plain[key], rtol=0, atol=1e-5)
    # The server never received a plaintext update, and keys were set up once for both rounds.
    assert all(ARRAYS not in r.content.array_records for r in grid.replies if not r.has_error())
    kinds = [m.metadata.message_type for m in grid.sent]
    assert kinds.count(ADVERTISE) == 6 and kinds.count(SHARE) == 6 and kinds.count(UNMASK) == 10  # t + 1 = 5 survivors per round


def _dropping(grid: LoopbackGrid, stage: str, nodes: set[int], *, pushes: set[int] | None = None) -> None:
    """Lose the replies of ``nodes`` to messages of type ``stage`` (in the listed push numbers only)."""
    count = {"n": 0}

    def drop(sent: list[Message], replies: list[Message]) -> list[Message]:
        if sent and sent[0].metadata.message_type == stage:
            count["n"] += 1
            if pushes is None or count["n"] in pushes:
                return [r for r in replies if r.metadata.src_node_id not in nodes]
        return replies

    grid.drop = drop


SHORT = {"round-timeout": 1.0, "secagg-stage-timeout": 1.0}


def test_dropouts_up_to_n_minus_t_at_train_and_unmask_still_give_a_round(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    ids = list(contexts)
    # t = 4 of 6: node 0 never sends its masked input; node 1 sends it, but its unmask reply is lost.
    grid = LoopbackGrid(contexts, {ids[0]: silent})
    _dropping(grid, UNMASK, {ids[1]})
    federation, repo = _federation(tmp_path, grid, **{**SECURE, "round-timeout": 1.0, "secagg-stage-timeout": 60.0,
                                                      "num-rounds": 1})
    run = repo.get_run(federation.run())
    [rnd] = run.rounds
    assert rnd.status == RoundStatus.COMPLETED
    assert sorted(rnd.participants) == ids[1:]  # node 1's masked input is in the sum; its shares were not needed
    stages = {f.node_id: f.stage for f in rnd.failures}
    assert stages == {ids[0]: "train"}
    # t + 1 = 5 survivors were asked to unmask and 4 = t answered: the stage ended with them, without
    # waiting out its 60 s deadline for the spare, which is not a failure (its answer was not needed)
    asked = [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == UNMASK]
    assert len(asked) == 5 and ids[1] in asked
    assert rnd.timings["secagg-unmask"] < 30.0


def test_unmask_asks_t_plus_spare_survivors_then_the_rest_if_too_few_answer(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    ids = list(contexts)
    grid = LoopbackGrid(contexts)
    _dropping(grid, UNMASK, {ids[0], ids[1]})  # 2 of the 5 first asked (t + 1) never answer: 3 < t = 4
    federation, repo = _federation(tmp_path, grid, **{**SECURE, **SHORT, "num-rounds": 1})
    run = repo.get_run(federation.run())
    [rnd] = run.rounds
    assert rnd.status == RoundStatus.COMPLETED and len(rnd.participants) == 6
    asked = [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == UNMASK]
    assert asked == ids[:5] + [ids[5]]


def test_too_many_dropouts_fail_the_round_cleanly_and_the_next_round_completes(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    ids = list(contexts)
    grid = LoopbackGrid(contexts)
    _dropping(grid, "train", set(ids[:3]), pushes={1})  # round 1: n − t + 1 = 3 of 6 masked inputs never arrive
    federation, repo = _federation(tmp_path, grid, **{**SECURE, **SHORT, "num-rounds": 2})
    run = repo.get_run(federation.run())

    first, second = run.rounds
    assert first.status == RoundStatus.FAILED and "quorum" in (first.error or "")
    assert second.status == RoundStatus.COMPLETED and len(second.participants) == 6
    assert [v.round for v in repo.list_model_versions(run_id=run.id)] == [2]
    # Round 1 never asked anyone to unmask; round 2 asked t + 1 = 5 survivors.
    assert [m.metadata.message_type for m in grid.sent].count(UNMASK) == 5


def test_a_node_that_lost_its_keys_fails_one_round_and_the_next_round_re_keys(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    ids = list(contexts)
    grid = LoopbackGrid(contexts)
    pushes = {"train": 0}

    def forget(sent: list[Message], replies: list[Message]) -> list[Message]:
        if sent and sent[0].metadata.message_type == "train":
            pushes["train"] += 1
            if pushes["train"] == 1:  # after round 1, node 0's SuperNode restarts and loses its state
                contexts[ids[0]].state = RecordDict()
        return replies

    grid.drop = forget
    federation, repo = _federation(tmp_path, grid, **{**SECURE, **SHORT, "num-rounds": 3})
    run = repo.get_run(federation.run())
    r1, r2, r3 = run.rounds
    assert [len(r.participants) for r in (r1, r2, r3)] == [6, 5, 6]
    [failure] = r2.failures
    assert failure.node_id == ids[0] and "holds no secure-aggregation keys" in failure.reason
    assert [m.metadata.message_type for m in grid.sent].count(ADVERTISE) == 12  # re-keyed for round 3


@pytest.mark.parametrize("stage", [ADVERTISE, SHARE])
def test_a_node_lost_during_key_set_up_is_left_out_and_joins_after_re_keying(
    tmp_path: Path, six_parts: dict[str, Path], stage: str
) -> None:
    contexts = _contexts(six_parts)
    ids = list(contexts)
    grid = LoopbackGrid(contexts)
    _dropping(grid, stage, {ids[0]}, pushes={1})  # only the first key set-up loses node 0
    federation, repo = _federation(tmp_path, grid, **{**SECURE, **SHORT, "num-rounds": 2})
    run = repo.get_run(federation.run())
    r1, r2 = run.rounds
    assert r1.status == RoundStatus.COMPLETED and sorted(r1.participants) == ids[1:]
    assert {(f.node_id, f.stage) for f in r1.failures} == {(ids[0], stage.replace("query.", "").replace("_", "-"))}
    # Round 2 selects node 0 again, which is outside the epoch: a new key set-up takes it in.
    assert r2.status == RoundStatus.COMPLETED and len(r2.participants) == 6


def test_one_nodes_garbage_masked_input_is_refused_by_range_and_the_model_stays(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    ids = list(contexts)
    rng = np.random.default_rng(0)

    def garbage(request: Message, reply: Message) -> Message:  # a node (or a bug) sends noise instead of its input
        record = reply.content.array_records[MASKED]
        vector = record["masked"].numpy()
        noise = rng.integers(0, np.iinfo(vector.dtype).max, size=vector.shape, dtype=vector.dtype)
        content = RecordDict({**reply.content, MASKED: ArrayRecord({"masked": Array(noise)})})
        return Message(content=content, reply_to=request)

    grid = LoopbackGrid(contexts, {ids[2]: garbage})
    federation, repo = _federation(tmp_path, grid, **{**SECURE, "num-rounds": 1})
    with pytest.raises(FederationError, match="none of the 1 round"):
        federation.run()
    [run] = repo.list_runs()
    [first] = repo.get_run(run.id).rounds
    assert first.status == RoundStatus.FAILED
    assert "round 1 cluster 0: the revealed sum is out of range" in (first.error or "")
    assert repo.list_model_versions(run_id=run.id) == []  # nothing was applied


def test_the_range_check_passes_every_honest_sum_and_names_each_broken_bound() -> None:
    from quorumfl.aggregation.secagg import read_payload, weighted_payload
    from quorumfl.errors import SecureAggregationError

    rng = np.random.default_rng(3)
    honest = sum(weighted_payload(rng.normal(0, 3, 50), examples=float(rng.integers(1, 500)), loss=float(rng.uniform()),
                                  max_weight=100.0, clip=2.0, value=float(rng.uniform()), eval_loss=float(rng.uniform(0, 9)))
                 for _ in range(5))
    read_payload(honest, min_weight=1e-6, contributors=5, clip=2.0, tolerance=1e-9)
    above = 2.0 * honest[0] + 1

    def replaced(index: int, value: float) -> np.ndarray:
        return np.concatenate([honest[:index], [value], honest[index + 1:]])

    from quorumfl.aggregation.secagg.payload import BUCKETS, HEADER, SCALARS

    filled = int(np.nonzero(honest[SCALARS:SCALARS + BUCKETS])[0][0]) + SCALARS  # a norm bucket with nodes in it
    for bad, reason in ((replaced(0, 6.0), "total weight"), (replaced(0, -9.0), "total weight"),
                        (replaced(1, -1.0), "weighted loss"), (replaced(2, -1.0), "weighted evaluated value"),
                        (replaced(3, above), "weighted evaluated loss"), (replaced(HEADER, above), "above clip"),
                        (replaced(SCALARS, 6.0), "histogram bucket is outside"),
                        (replaced(filled, honest[filled] + 1), "norm histogram counts 6"),
                        (replaced(SCALARS + BUCKETS + 3, -1.0), "loss histogram counts 4")):
        with pytest.raises(SecureAggregationError, match=reason):
            read_payload(bad, min_weight=1e-6, contributors=5, clip=2.0, tolerance=1e-9)


def test_the_secure_sum_reveals_the_weighted_means_of_the_nodes_evaluations() -> None:
    """Header of the secure sum against a plain weighted mean: train loss, evaluated value and loss
    (each clipped to [0, clip], a non-finite one counting as 0)."""
    from quorumfl.aggregation.secagg import read_payload, weighted_payload

    rng = np.random.default_rng(4)
    examples = rng.integers(1, 300, 6).astype(float)
    values, losses = rng.uniform(0, 1, 6), rng.uniform(0, 3, 6)
    total = sum(weighted_payload(np.zeros(3), examples=e, loss=1.0, max_weight=200.0, clip=2.0, value=v, eval_loss=el)
                for e, v, el in zip(examples, values, losses, strict=True))
    mean = read_payload(total, min_weight=1e-6, contributors=6, clip=2.0, tolerance=1e-9)
    w = np.minimum(examples, 200.0)
    assert mean.eval_value == pytest.approx(float(np.sum(w * values) / w.sum()), rel=1e-12)
    assert mean.eval_loss == pytest.approx(float(np.sum(w * np.minimum(losses, 2.0)) / w.sum()), rel=1e-12)
    assert mean.train_loss == pytest.approx(1.0)
    nan = weighted_payload(np.zeros(3), examples=10.0, loss=float("nan"), max_weight=200.0, clip=2.0)
    assert list(nan[:4]) == [0.05, 0.0, 0.0, 0.0]


def test_the_secure_sum_reveals_norm_and_loss_histograms_and_the_node_bounds_its_norm() -> None:
    """The revealed histograms equal a plain count of each node's norm and loss bucket (numpy reference);
    with a norm bound the update is scaled to it while its bucket keeps the norm it had."""
    from quorumfl.aggregation.secagg import read_payload, weighted_payload
    from quorumfl.aggregation.secagg.payload import BUCKETS, HEADER, LOSS_EDGES, NORM_EDGES

    rng = np.random.default_rng(5)
    updates = [rng.normal(0, s, 40) for s in (0.01, 0.02, 0.015, 0.02, 1.0)]  # the last one stands out
    losses = [0.4, 0.5, 0.45, 0.5, 30.0]
    total = sum(weighted_payload(u, examples=50.0, loss=loss, max_weight=100.0, clip=0.5, norm_bound=0.2)
                for u, loss in zip(updates, losses, strict=True))
    mean = read_payload(total, min_weight=1e-6, contributors=5, clip=0.5, tolerance=1e-9)
    norms = [float(np.linalg.norm(u)) for u in updates]
    assert list(mean.norm_histogram) == list(np.bincount(np.searchsorted(NORM_EDGES, norms, side="right"),
                                                         minlength=BUCKETS).astype(float))
    assert list(mean.loss_histogram) == list(np.bincount(np.searchsorted(LOSS_EDGES, losses, side="right"),
                                                         minlength=BUCKETS).astype(float))
    bounded = weighted_payload(updates[4], examples=100.0, loss=1.0, max_weight=100.0, norm_bound=0.2)
    assert float(np.linalg.norm(bounded[HEADER:])) == pytest.approx(0.2)
    assert float(np.linalg.norm(weighted_payload(updates[0], examples=100.0, loss=1.0, max_weight=100.0,
                                                 norm_bound=0.2)[HEADER:])) == pytest.approx(norms[0])


CKKS_MODE = {"secure-aggregation": "ckks", "secagg-threshold": 0.6}


@pytest.mark.parametrize("retries", [1, 0])
@pytest.mark.parametrize(("mode", "atol"), [(SECURE, 1e-5), (CKKS_MODE, 1e-6)], ids=["masking", "ckks"])
def test_a_node_whose_clientapp_crashed_mid_training_is_asked_again_in_a_secure_round(
    tmp_path: Path, six_parts: dict[str, Path], retries: int, mode: dict[str, object], atol: float
) -> None:
    """As in plaintext rounds, the same request goes to the node again (``train-retries``). The crashed
    ClientApp never replied: in a masked round its slot was never used, so the node trains from the same
    model with the same participant set (its contribution ledger admits that) and masks with the slot
    once; in a CKKS round its ledger holds no encryption under the round's nonce, so it encrypts once.
    The sum equals plaintext FedAvg (within the fixed-point or CKKS error). With no retries the crash is
    final and the round completes without the node."""
    contexts = _contexts(six_parts, REPRODUCIBLE)
    ids = list(contexts)
    grid = LoopbackGrid(contexts, crashes={ids[2]: 1})
    federation, repo = _federation(tmp_path, grid, **{**mode, "num-rounds": 1, "train-retries": retries})
    run_id = federation.run()
    [rnd] = repo.get_run(run_id).rounds

    assert rnd.status == RoundStatus.COMPLETED
    asked = [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "train"]
    assert asked.count(ids[2]) == 1 + retries and asked.count(ids[0]) == 1
    metric = {m.node_id: m.value for m in repo.metrics(run_id) if m.name == "train-retries"}
    decryptions = repo.decryptions(run_id)  # CKKS: the one decryption's contributors
    assert [sorted(d.contributors) for _, d in decryptions] == ([sorted(rnd.participants)] if mode["secure-aggregation"] == "ckks" else [])
    if retries:
        assert sorted(rnd.participants) == ids and rnd.failures == [] and metric == {ids[2]: 1.0}
        plain_fed, plain_repo = _federation(tmp_path / "plain", LoopbackGrid(_contexts(six_parts, REPRODUCIBLE)),
                                            **{"num-rounds": 1})
        [plain] = _models(plain_repo, plain_fed.run())
        [secure] = _models(repo, run_id)
        for key in plain:
            np.testing.assert_allclose(secure[key], plain[key], rtol=0, atol=atol)
        if mode["secure-aggregation"] == "ckks":  # one encryption under the round's nonce
            [(_, decryption)] = decryptions
            stored = KeyStore(tmp_path / "home" / "node-keys" / str(ids[2])).load_key(decryption.key_id or "")
            assert len(stored.encrypted) == 1
    else:
        assert sorted(rnd.participants) == sorted(set(ids) - {ids[2]}) and metric == {}
        assert [(f.node_id, f.stage) for f in rnd.failures] == [(ids[2], "train")]
        assert "node error 8" in rnd.failures[0].reason


@pytest.mark.parametrize(("mode", "record", "refusal"), [
    (SECURE, MASKED, "slot 0 was already used; a mask key is never used twice"),
    (CKKS_MODE, ENCRYPTED, "already encrypted an update under key"),
], ids=["masking", "ckks"])
def test_a_server_that_claims_a_crash_after_the_node_replied_gets_no_second_input(
    tmp_path: Path, six_parts: dict[str, Path], mode: dict[str, object], record: str, refusal: str
) -> None:
    """The attacker: the node's ClientApp finished and its input left, but the server reports Flower's
    CLIENT_APP_CRASHED for it and asks again (``train-retries``), hoping for a second input: under the
    same masks (masking) or the round's common c1 (CKKS), the difference of the two would be the
    difference of two of the node's updates. The node refuses: a mask key is never used twice, and a
    node encrypts at most once under a round nonce."""
    contexts = _contexts(six_parts)
    ids = list(contexts)
    replied: list[Message] = []
    grid = LoopbackGrid(contexts, {ids[2]: withheld_as_crashed(replied)})
    federation, repo = _federation(tmp_path, grid, **{**mode, "num-rounds": 1, "train-retries": 1})
    [rnd] = repo.get_run(federation.run()).rounds

    first, second = replied
    assert record in first.content.array_records  # what the server withheld as "crashed"
    assert second.has_error() and refusal in second.error.reason
    assert rnd.status == RoundStatus.COMPLETED and ids[2] not in rnd.participants
    assert [(f.node_id, f.stage) for f in rnd.failures] == [(ids[2], "train")]
