"""Threshold-CKKS rounds through the federation loop and the real ClientApp handlers (in-process Grid).

The decrypted result is compared with the same run in plaintext mode: same seeds, same data, so
the only difference allowed is the CKKS error (~1e-8 per coordinate).
"""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from quorumfl.aggregation.ckks import CkksParams, ceremony_in_one_process
from quorumfl.client.app import app
from quorumfl.errors import SecureAggregationError
from quorumfl.privacy.keystore import KeyStore
from quorumfl.protocol.ckks_wire import CKKS as CKKS_RECORD
from quorumfl.protocol.ckks_wire import (
    COMMIT,
    DECRYPT,
    FINISH,
    REVEAL,
    decode_train_request,
    encode_train_request,
)
from quorumfl.protocol.wire import ARRAYS
from quorumfl.server.config import RunConfig
from quorumfl.server.state.repository import RoundStatus, RunStatus

from .test_rounds import (
    REPRODUCIBLE,
    LoopbackGrid,
    _contexts,
    _federation,
    task_identity,  # noqa: F401  (an autouse fixture)
)
from .test_secure_rounds import _models

CKKS = {"secure-aggregation": "ckks", "secagg-threshold": 0.6}  # t = 4 of 6
SHORT = {"round-timeout": 2.0, "secagg-stage-timeout": 2.0}


def _kinds(grid: LoopbackGrid) -> list[str]:
    return [m.metadata.message_type for m in grid.sent]


def _drop_replies(grid: LoopbackGrid, stage: str, nodes: set[int], *, pushes: set[int] | None = None) -> None:
    count = {"n": 0}

    def drop(sent: list[Message], replies: list[Message]) -> list[Message]:
        if sent and sent[0].metadata.message_type == stage:
            count["n"] += 1
            if pushes is None or count["n"] in pushes:
                return [r for r in replies if r.metadata.src_node_id not in nodes]
        return replies

    grid.drop = drop


def test_ckks_rounds_equal_plaintext_fedavg_and_cost_two_round_trips(
    tmp_path: Path, six_parts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_fed, repo = _federation(tmp_path, LoopbackGrid(_contexts(six_parts, REPRODUCIBLE)))
    plain_models = _models(repo, plain_fed.run())

    grid = LoopbackGrid(_contexts(six_parts, REPRODUCIBLE))
    fed, repo = _federation(tmp_path, grid, **CKKS)
    run_id = fed.run()

    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    for plain, decrypted in zip(plain_models, _models(repo, run_id), strict=True):
        for key in plain:
            np.testing.assert_allclose(decrypted[key], plain[key], rtol=0, atol=1e-6)
    assert all(ARRAYS not in r.content.array_records for r in grid.replies if not r.has_error())
    kinds = _kinds(grid)
    # One ceremony (3 trips to 6 nodes); per round: train to 6, decrypt to t = 4.
    assert [kinds.count(k) for k in (COMMIT, REVEAL, FINISH, DECRYPT, "train")] == [6, 6, 6, 8, 12]
    [ceremony] = repo.ceremonies(run_id)
    assert ceremony.status == "complete" and ceremony.threshold == 4 and len(ceremony.holders) == 6
    decryptions = repo.decryptions(run_id)
    assert [(n, d.status, len(d.decryptors), len(d.contributors)) for n, d in decryptions] == [
        (1, "complete", 4, 6), (2, "complete", 4, 6)]
    assert decryptions[0][1].decryptors != decryptions[1][1].decryptors  # S rotates
    for node in grid.nodes:
        store = KeyStore(Path(tmp_path / "home" / "node-keys" / str(node)))
        [key_id] = store.keys()
        assert key_id == ceremony.key_id
        mode = stat.S_IMODE((store.directory / f"key-{key_id}.json").stat().st_mode)
        assert mode == 0o600
        stored = store.load_key(key_id)
        assert stored.asked == {(n, 0) for n, d in decryptions if node in d.decryptors}
        assert len(stored.encrypted) == 2  # one round nonce per round it encrypted in
    # The server replays a round's train request to a node: it would get a second encryption under
    # that round's c1 (the difference of two updates); the node's ledger refuses.
    replayed = next(m for m in grid.sent if m.metadata.message_type == "train")
    node = replayed.metadata.dst_node_id
    with pytest.raises(SecureAggregationError, match="already encrypted"):
        app(Message(content=replayed.content, dst_node_id=node, message_type="train"), grid.nodes[node])


def test_nodes_lost_after_encryption_outside_s_do_not_matter_and_a_lost_decryptor_fails_the_round_cleanly(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    grid = LoopbackGrid(contexts)
    # Round 1: S is 4 of the 6 contributors; one decryptor's answer is lost -> nothing is decrypted.
    lost: set[int] = set()

    def drop(sent: list[Message], replies: list[Message]) -> list[Message]:
        if sent and sent[0].metadata.message_type == DECRYPT and not lost:
            lost.add(int(sent[0].metadata.dst_node_id))
            return [r for r in replies if r.metadata.src_node_id not in lost]
        return replies

    grid.drop = drop
    fed, repo = _federation(tmp_path, grid, **{**CKKS, **SHORT, "num-rounds": 2})
    run = repo.get_run(fed.run())
    first, second = run.rounds
    assert first.status == RoundStatus.FAILED and "did not answer" in (first.error or "")
    assert {(f.node_id, f.stage) for f in first.failures} == {(next(iter(lost)), "ckks-decrypt")}
    assert second.status == RoundStatus.COMPLETED and len(second.participants) == 6
    assert [v.round for v in repo.list_model_versions(run_id=run.id)] == [2]
    statuses = [d.status for _, d in repo.decryptions(run.id)]
    assert statuses == ["failed", "complete"]


def test_fewer_than_t_contributors_end_the_round_before_any_decryption(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    ids = list(contexts)
    grid = LoopbackGrid(contexts)
    _drop_replies(grid, "train", set(ids[:3]), pushes={1})  # 3 of 6 encrypted updates lost; t = 4
    fed, repo = _federation(tmp_path, grid, **{**CKKS, **SHORT, "num-rounds": 2})
    run = repo.get_run(fed.run())
    first, second = run.rounds
    assert first.status == RoundStatus.FAILED and "fewer than t=4" in (first.error or "")
    assert second.status == RoundStatus.COMPLETED
    assert _kinds(grid).count(DECRYPT) == 4  # only round 2 asked anyone to decrypt


def test_an_admin_requested_ceremony_re_keys_before_the_next_round(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    grid = LoopbackGrid(contexts)
    fed, repo = _federation(tmp_path, grid, **{**CKKS, "num-rounds": 2})
    trains = {"n": 0}

    def request(sent: list[Message], replies: list[Message]) -> list[Message]:
        if sent and sent[0].metadata.message_type == "train":
            trains["n"] += 1
            if trains["n"] == 1:
                [run] = repo.list_runs()[-1:]
                repo.request_ceremony(run.id)  # what 'quorumfl keys ceremony RUN' does
        return replies

    grid.drop = request
    run = repo.get_run(fed.run())
    assert run.status == RunStatus.COMPLETED
    first, second = repo.ceremonies(run.id)
    assert first.status == second.status == "complete" and first.key_id != second.key_id
    assert [d.key_id for _, d in repo.decryptions(run.id)] == [first.key_id, second.key_id]
    assert _kinds(grid).count(COMMIT) == 12


def test_a_node_that_joined_after_the_ceremony_refuses_a_key_it_cannot_check_and_the_server_re_keys(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    contexts = _contexts(six_parts)
    late = list(contexts)[-1]
    grid = LoopbackGrid({n: c for n, c in contexts.items() if n != late})

    def join(sent: list[Message], replies: list[Message]) -> list[Message]:  # connects during round 1's decryption
        if sent and sent[0].metadata.message_type == DECRYPT:
            grid.nodes[late] = contexts[late]
        return replies

    grid.drop = join
    fed, repo = _federation(tmp_path, grid, **CKKS)
    run = repo.get_run(fed.run())
    assert [r.status for r in run.rounds] == [RoundStatus.COMPLETED, RoundStatus.COMPLETED]
    first, second = repo.ceremonies(run.id)
    assert len(first.holders) == 5 and len(second.holders) == 6  # the newcomer got a share before round 2
    assert len(run.rounds[1].participants) == 6

    # The attack: the server hands a node a public key of its own making (it knows that key's secret).
    train = next(m for m in grid.sent if m.metadata.message_type == "train")
    request = decode_train_request(train.content.config_records[CKKS_RECORD])
    coordinator, _, _ = ceremony_in_one_process([1, 2], 2, CkksParams())
    assert coordinator.public_key is not None

    def forged(key_id: str, public_key: bytes) -> Message:
        request.key_id, request.public_key = key_id, public_key
        content = RecordDict({**train.content, CKKS_RECORD: encode_train_request(request)})
        return Message(content=content, dst_node_id=late, message_type="train")

    newcomer = Context(run_id=99, node_id=4242, node_config={**contexts[late].node_config}, state=RecordDict(),
                       run_config={})  # a node that was in no ceremony of this run
    with pytest.raises(SecureAggregationError, match="holds no share of key"):
        app(forged(coordinator.key_id, coordinator.public_key), newcomer)
    with pytest.raises(SecureAggregationError, match="is not the one this node holds"):  # a member, same key id
        app(forged(second.key_id, coordinator.public_key), contexts[late])


def test_a_contribution_whose_record_names_another_ciphertext_is_dropped_and_the_round_goes_on(
    tmp_path: Path, six_parts: dict[str, Path]
) -> None:
    """The server binds each department's signed record to the c0 it actually received: two nodes'
    ciphertexts swapped on the way (a relay mixing them up, or one department passing off another's
    update) no longer match their records, both are dropped with a reason, and the four others
    (t = 4) still make the round."""
    contexts = _contexts(six_parts)
    grid = LoopbackGrid(contexts)
    swapped: list[int] = []

    def swap(sent: list[Message], replies: list[Message]) -> list[Message]:
        if sent and sent[0].metadata.message_type == "train" and not swapped:
            first, second = replies[0].content, replies[1].content
            first["encrypted"], second["encrypted"] = second["encrypted"], first["encrypted"]
            swapped.extend(int(r.metadata.src_node_id) for r in replies[:2])
        return replies

    grid.drop = swap
    fed, repo = _federation(tmp_path, grid, **{**CKKS, "num-rounds": 1})
    [only] = repo.get_run(fed.run()).rounds
    assert only.status == RoundStatus.COMPLETED and len(only.participants) == 4
    refused = {(f.node_id, f.stage): f for f in only.failures}
    assert set(refused) == {(n, "train") for n in swapped}
    assert all("names another ciphertext" in f.reason for f in refused.values())


def test_a_ceremony_whose_inboxes_exceed_the_wave_budget_finishes_in_waves_from_a_spool_it_leaves_no_trace_of(
    tmp_path: Path, six_parts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server spools the n² bundles to an unlinked file and asks members to finish a few at a time;
    the key and the rounds are those of a ceremony held at once (the run equals plaintext FedAvg)."""
    import quorumfl.server.ckks as server_ckks

    plain_fed, repo = _federation(tmp_path, LoopbackGrid(_contexts(six_parts, REPRODUCIBLE)))
    plain_models = _models(repo, plain_fed.run())
    pushes: list[list[int]] = []

    def record(sent: list[Message], replies: list[Message]) -> list[Message]:
        if sent and sent[0].metadata.message_type == FINISH:
            pushes.append(sorted(m.metadata.dst_node_id for m in sent))
        return replies

    # each member's inbox holds 5 bundles: a budget of two inboxes makes waves of 2, 2 and 2
    grid = LoopbackGrid(_contexts(six_parts, REPRODUCIBLE))
    grid.drop = record
    sizes: list[int] = []
    real_waves = server_ckks.finish_waves

    def waves(members: list[int], size: object, budget: int | None = None) -> list[list[int]]:
        assert callable(size)
        sizes.extend(size(m) for m in members)
        return real_waves(members, size, 2 * max(size(m) for m in members))

    monkeypatch.setattr(server_ckks, "finish_waves", waves)
    fed, repo = _federation(tmp_path / "ckks", grid, **CKKS)
    run_id = fed.run()
    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    assert len(pushes) == 3 and all(len(p) == 2 for p in pushes)
    assert sorted(n for p in pushes for n in p) == sorted(grid.nodes)
    assert len(set(sizes)) == 1 and sizes[0] > 5 * 100_000  # five bundles of a share polynomial each
    [ceremony] = repo.ceremonies(run_id)
    assert ceremony.status == "complete" and len(ceremony.holders) == 6
    for plain, decrypted in zip(plain_models, _models(repo, run_id), strict=True):
        for key in plain:
            np.testing.assert_allclose(decrypted[key], plain[key], rtol=0, atol=1e-6)
    spool_dir = RunConfig.from_mapping({}).resolved_model_dir()  # the run's model folder (the test's home)
    assert spool_dir.is_dir() and tmp_path in spool_dir.parents
    assert not [p for p in spool_dir.rglob("*") if "ckks-bundles" in p.name]  # unlinked as it was made


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), max_size=20), budget=st.integers(1, 60))
def test_finish_waves_ask_every_member_once_in_order_within_the_budget(sizes: list[int], budget: int) -> None:
    from quorumfl.server.ckks import finish_waves

    members = [100 + i for i in range(len(sizes))]
    size = dict(zip(members, sizes, strict=True))
    waves = finish_waves(members, size.__getitem__, budget)
    assert [m for wave in waves for m in wave] == members
    assert all(wave for wave in waves)
    for wave in waves:
        assert len(wave) == 1 or sum(size[m] for m in wave) <= budget


def test_spooled_bundles_come_back_to_their_recipients_and_an_unwritable_folder_is_one_clear_error(tmp_path: Path) -> None:
    from quorumfl.errors import StateError
    from quorumfl.server.ckks import SpooledBundles

    rng = np.random.default_rng(0)
    sent = {(s, r): rng.bytes(int(rng.integers(0, 3000))) for s in range(5) for r in range(5) if s != r}
    with SpooledBundles(tmp_path / "spool") as spool:
        for (s, r), bundle in sent.items():
            spool.put(s, r, bundle)
        spool.put(1, 0, b"again")  # a sender's later bundle for a recipient replaces its earlier one
        sent[(1, 0)] = b"again"
        assert list((tmp_path / "spool").iterdir()) == []  # no name on disk, even while open
        for r in range(5):
            assert spool.inbox(r) == {s: b for (s, rr), b in sent.items() if rr == r}
            assert spool.size(r) == sum(len(b) for (s, rr), b in sent.items() if rr == r)
        assert spool.inbox(9) == {} and spool.size(9) == 0
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(StateError, match="cannot make the key ceremony's bundle file in .*set model-dir"):
        SpooledBundles(blocked)
