"""The federation loop over an in-process Grid that delivers messages to the real ClientApp handlers.

Faulty nodes are planted by rewriting honest replies (NaN, wrong shape, error, silence) so the
round must go on with the honest nodes and record why each bad one was left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from quorumfl.client.app import app
from quorumfl.core.data import prepare_partitions
from quorumfl.errors import ModelStoreError
from quorumfl.protocol.wire import ARRAYS, METRICS, from_array_record
from quorumfl.server.config import RunConfig
from quorumfl.server.model_store import ModelStore
from quorumfl.server.rounds import Federation
from quorumfl.server.state.database import connect
from quorumfl.server.state.repository import Repository, RoundStatus, RunStatus

Fault = Callable[[Message, Message], Message | None]  # (request, honest reply) -> what is sent


class LoopbackGrid(Grid):
    """Delivers each message to an in-process node: the real ClientApp, then an optional fault.

    ``push_messages`` runs the nodes at once; ``pull_messages`` hands out their replies. A silent
    node's reply never comes, so tests that plant one use a short round timeout. ``drop`` lets a
    test lose replies of one push (a node that died after receiving its message). ``crashes`` kills a
    node's ClientApp before it replies, that many times (in ``fault_stages``): the app never finishes,
    so, as on a SuperNode, none of its context changes are kept, and the reply is Flower's
    CLIENT_APP_CRASHED error (a ``Fault`` instead rewrites the reply of an app that did finish).
    """

    def __init__(
        self, nodes: dict[int, Context], faults: dict[int, Fault] | None = None, *, fault_stages: tuple[str, ...] = ("train",),
        crashes: dict[int, int] | None = None,
    ) -> None:
        self.nodes = nodes
        self.faults = faults or {}
        self.fault_stages = fault_stages
        self.crashes = dict(crashes or {})
        self.drop: Callable[[list[Message], list[Message]], list[Message]] = lambda _sent, replies: replies
        self.sent: list[Message] = []
        self.replies: list[Message] = []
        self._pending: dict[str, Message] = {}

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    # The loop only uses get_node_ids, push_messages and pull_messages; the rest of Grid is out of scope.
    def set_run(self, run: object) -> None:
        raise AssertionError("not used by the federation loop")

    @property
    def run(self) -> object:
        raise AssertionError("not used by the federation loop")

    def create_message(self, *args: object, **kwargs: object) -> Message:
        raise AssertionError("not used by the federation loop")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        raise AssertionError("not used by the federation loop")

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        batch = list(messages)
        out: list[Message] = []
        for msg in batch:
            msg.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"  # the SuperLink assigns ids
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            if self.crashes.get(node, 0) > 0 and msg.metadata.message_type in self.fault_stages:
                self.crashes[node] -= 1
                out.append(Message(Error(code=8, reason="ClientApp stopped responding."), reply_to=msg))
                continue
            try:
                reply: Message | None = app(msg, self.nodes[node])  # routed by message type, as on a node
            except Exception as exc:  # what Flower turns into an error reply
                reply = Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            fault = self.faults.get(node)
            if fault is not None and reply is not None and msg.metadata.message_type in self.fault_stages:
                reply = fault(msg, reply)
            if reply is not None:
                out.append(reply)
        out = self.drop(batch, out)
        self.replies.extend(out)
        self._pending.update({r.metadata.reply_to_message_id: r for r in out})
        return [m.metadata.message_id for m in batch]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._pending.pop(mid) for mid in list(message_ids) if mid in self._pending]


def _with_arrays(
    request: Message, reply: Message, change: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
) -> Message:
    arrays = change(from_array_record(reply.content.array_records[ARRAYS]))
    content = RecordDict({**reply.content, ARRAYS: ArrayRecord({k: Array(v) for k, v in arrays.items()})})
    return Message(content=content, reply_to=request)


def nan_update(request: Message, reply: Message) -> Message:
    def poison(a: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        key = next(iter(a))
        bad = a[key].copy()
        bad.flat[0] = np.nan
        return {**a, key: bad}

    return _with_arrays(request, reply, poison)


def wrong_shape(request: Message, reply: Message) -> Message:
    return _with_arrays(request, reply, lambda a: {k: (v[:1] if v.ndim == 2 else v) for k, v in a.items()})


def error_reply(request: Message, _reply: Message) -> Message:
    return Message(Error(code=1, reason="ClientApp raised DataError: partition missing"), reply_to=request)


def silent(_request: Message, _reply: Message) -> None:
    return None


@pytest.fixture
def federation_parts(tmp_path: Path) -> dict[str, Path]:
    names = ["tax-office", "urban-planning", "public-works", "nan-node", "shape-node", "error-node", "silent-node"]
    return prepare_partitions(tmp_path / "data", names, seed=0, method="iid")


@pytest.fixture(autouse=True)
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TaskIdentity, "_run_id", 99)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


# Secure rounds train from the node's own entropy; a comparison with plaintext needs the departments
# to opt into repeatable training (node config), as a department reproducing a result would.
REPRODUCIBLE: dict[str, bool | int | float | str] = {"reproducible-training": True}


def _contexts(parts: dict[str, Path], extra: dict[str, bool | int | float | str] | None = None) -> dict[int, Context]:
    """In-process nodes; ``extra``: node config every node adds (e.g. reproducible-training)."""
    return {
        1000 + i: Context(run_id=99, node_id=1000 + i, node_config={"data-path": str(p), "department": name, **(extra or {})},
                          state=RecordDict(), run_config={})
        for i, (name, p) in enumerate(parts.items())
    }


def _federation(tmp_path: Path, grid: Grid, **overrides: object) -> tuple[Federation, Repository]:
    config = RunConfig.from_mapping({"num-rounds": 2, "local-epochs": 1, "min-nodes": 2, "start-from": "fresh",
                                   "secure-aggregation": "none", **overrides})
    if isinstance(grid, LoopbackGrid) and any(c.run_config.get("roster") for c in grid.nodes.values()):
        for context in grid.nodes.values():  # a signed run: the nodes hold every key of it, as a deployed bundle does
            context.run_config.update(config.resolved())
    repo = Repository(connect(f"sqlite:///{tmp_path / 'state.db'}", migrate=True))
    flower_run_id = 99 + len(repo.list_runs())
    return Federation(grid, config, repo, ModelStore(tmp_path / "models"), flower_run_id=flower_run_id), repo


def _assert_first_model_is_weighted_mean(repo: Repository, run_id: int, replies: list[Message]) -> None:
    """The stored round-1 model equals the example-weighted mean of ``replies`` (a plain numpy reference)."""
    weights = np.array([r.content.metric_records[METRICS]["num-examples"] for r in replies], dtype=np.float64)
    version = repo.list_model_versions(run_id=run_id)[0]
    stored = ModelStore.load(version.path, version.sha256)
    for key, value in stored.items():
        stack = np.stack([from_array_record(r.content.array_records[ARRAYS])[key] for r in replies]).astype(np.float64)
        np.testing.assert_allclose(value, np.tensordot(weights / weights.sum(), stack, axes=1), rtol=1e-5, atol=1e-6)


def test_bad_nodes_are_left_out_and_recorded(tmp_path: Path, federation_parts: dict[str, Path]) -> None:
    contexts = _contexts(federation_parts)
    ids = list(contexts)
    faults: dict[int, Fault] = {ids[3]: nan_update, ids[4]: wrong_shape, ids[5]: error_reply, ids[6]: silent}
    grid = LoopbackGrid(contexts, faults)
    federation, repo = _federation(tmp_path, grid, **{"round-timeout": 1.0})

    run_id = federation.run()

    run = repo.get_run(run_id)
    assert run.status == RunStatus.COMPLETED
    first = run.rounds[0]
    assert first.status == RoundStatus.COMPLETED
    assert sorted(first.participants) == ids[:3]
    reasons = {f.node_id: (f.stage, f.reason) for f in first.failures}
    assert reasons[ids[3]][0] == "aggregate" and "non-finite" in reasons[ids[3]][1]
    assert reasons[ids[4]][0] == "aggregate" and "shape mismatch" in reasons[ids[4]][1]
    assert reasons[ids[5]][0] == "train" and "partition missing" in reasons[ids[5]][1]
    assert reasons[ids[6]][0] == "train" and "no reply" in reasons[ids[6]][1]

    # The stored round-1 model is exactly the example-weighted mean of the honest replies.
    honest = [r for r in grid.replies[: len(ids) - 1] if r.metadata.src_node_id in ids[:3]]
    _assert_first_model_is_weighted_mean(repo, run_id, honest)

    departments = {n.node_id: n.department for n in repo.list_nodes()}
    assert departments[ids[0]] == "tax-office"
    finals = {m.node_id for m in repo.metrics(run_id) if m.name == "final-accuracy"}
    assert set(ids[:3]) <= finals


def test_disabled_nodes_are_never_selected(tmp_path: Path, federation_parts: dict[str, Path]) -> None:
    contexts = _contexts(dict(list(federation_parts.items())[:3]))
    ids = list(contexts)
    grid = LoopbackGrid(contexts)
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 1})
    repo.touch_node(ids[1], department="urban-planning")
    repo.set_enabled("urban-planning", False)
    federation.run()
    assert ids[1] not in {m.metadata.dst_node_id for m in grid.sent}


def test_rollback_sets_where_the_next_run_starts(tmp_path: Path, federation_parts: dict[str, Path]) -> None:
    contexts = _contexts(dict(list(federation_parts.items())[:3]))
    federation, repo = _federation(tmp_path, LoopbackGrid(contexts))
    run_id = federation.run()
    v1, v2 = repo.list_model_versions(run_id=run_id)
    assert repo.heads() == {v2.architecture: v2.id}
    repo.rollback(v1.id)

    grid = LoopbackGrid(contexts)
    federation, repo = _federation(tmp_path, grid, **{"start-from": "head", "num-rounds": 1})
    new_run = federation.run()
    sent = from_array_record(grid.sent[0].content.array_records[ARRAYS])
    expected = ModelStore.load(v1.path, v1.sha256)
    assert all(np.array_equal(sent[k], expected[k]) for k in expected)
    assert repo.list_model_versions(run_id=new_run)[0].parent_id == v1.id


def test_tampered_head_fails_the_run_and_keeps_history(tmp_path: Path, federation_parts: dict[str, Path]) -> None:
    contexts = _contexts(dict(list(federation_parts.items())[:3]))
    federation, repo = _federation(tmp_path, LoopbackGrid(contexts), **{"num-rounds": 1})
    first_run = federation.run()
    [version] = repo.list_model_versions(run_id=first_run)
    data = bytearray(Path(version.path).read_bytes())
    data[-1] ^= 0xFF
    Path(version.path).write_bytes(bytes(data))

    federation, repo = _federation(tmp_path, LoopbackGrid(contexts), **{"start-from": "head"})
    with pytest.raises(ModelStoreError, match="SHA-256"):
        federation.run()
    runs = repo.list_runs()
    assert [r.status for r in runs] == [RunStatus.COMPLETED, RunStatus.FAILED]
    assert "SHA-256" in (runs[1].error or "")
    assert len(repo.list_model_versions()) == 1 and len(repo.metrics(first_run)) > 0


def test_too_few_valid_updates_fails_the_round_not_the_model(tmp_path: Path, federation_parts: dict[str, Path]) -> None:
    contexts = _contexts(dict(list(federation_parts.items())[:3]))
    ids = list(contexts)
    grid = LoopbackGrid(contexts, {ids[1]: nan_update, ids[2]: silent})
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 1, "round-timeout": 1.0})
    with pytest.raises(Exception, match="none of the 1 round"):
        federation.run()
    [run] = repo.list_runs()
    assert run.status == RunStatus.FAILED and run.rounds[0].status == RoundStatus.FAILED
    assert "1 valid update(s) of 3 selected" in (run.rounds[0].error or "")
    assert repo.list_model_versions() == []


def crashes(times: int) -> Fault:
    """A ClientApp killed mid-training ``times`` times (Flower's CLIENT_APP_CRASHED), honest after."""
    left = [times]

    def fault(request: Message, reply: Message) -> Message:
        if left[0] <= 0:
            return reply
        left[0] -= 1
        return Message(Error(code=8, reason="ClientApp stopped responding."), reply_to=request)

    return fault


def withheld_as_crashed(replied: list[Message]) -> Fault:
    """A lying server's view of a node whose ClientApp finished: its first reply is kept (in
    ``replied``) and reported as Flower's CLIENT_APP_CRASHED, so the server asks again; the replies
    after it pass, and are kept too."""

    def fault(request: Message, reply: Message) -> Message:
        replied.append(reply)
        if len(replied) == 1:
            return Message(Error(code=8, reason="ClientApp stopped responding."), reply_to=request)
        return reply

    return fault


def _train_sent(grid: LoopbackGrid, node: int) -> int:
    return sum(1 for m in grid.sent if m.metadata.dst_node_id == node and m.metadata.message_type == "train")


def test_a_crashed_clientapp_is_asked_again_within_the_round(tmp_path: Path, federation_parts: dict[str, Path]) -> None:
    contexts = _contexts(dict(list(federation_parts.items())[:3]))
    ids = list(contexts)
    grid = LoopbackGrid(contexts, {ids[2]: crashes(1)})
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 1})
    run_id = federation.run()

    [first] = repo.get_run(run_id).rounds
    assert sorted(first.participants) == ids and first.failures == []
    assert _train_sent(grid, ids[2]) == 2 and _train_sent(grid, ids[0]) == 1
    retries = {m.node_id: m.value for m in repo.metrics(run_id) if m.name == "train-retries"}
    assert retries == {ids[2]: 1.0}
    # The model is the mean of the three good replies, the retried node's second one included.
    good = [r for r in grid.replies if not r.has_error() and r.metadata.message_type == "train"]
    assert sorted(int(r.metadata.src_node_id) for r in good) == ids
    _assert_first_model_is_weighted_mean(repo, run_id, good)


def test_retries_are_bounded_and_other_errors_are_final(tmp_path: Path, federation_parts: dict[str, Path]) -> None:
    contexts = _contexts(dict(list(federation_parts.items())[:4]))
    ids = list(contexts)
    grid = LoopbackGrid(contexts, {ids[2]: crashes(5), ids[3]: error_reply})
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 1, "train-retries": 2})
    run_id = federation.run()

    [first] = repo.get_run(run_id).rounds
    assert sorted(first.participants) == ids[:2]
    reasons = {f.node_id: f.reason for f in first.failures}
    assert "node error 8" in reasons[ids[2]] and "after 2 retries" in reasons[ids[2]]
    assert "partition missing" in reasons[ids[3]] and "retries" not in reasons[ids[3]]
    assert _train_sent(grid, ids[2]) == 3 and _train_sent(grid, ids[3]) == 1


def test_a_running_round_records_its_stage_and_nodes(tmp_path: Path, federation_parts: dict[str, Path]) -> None:
    """What `runs start --follow` shows while a round runs: the stage, and how many of the asked nodes
    replied, failed or are still awaited (an error reply fails, a silent node stays awaited)."""
    contexts = _contexts(dict(list(federation_parts.items())[:5]))
    ids = list(contexts)
    grid = LoopbackGrid(contexts, {ids[3]: error_reply, ids[4]: silent})
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 1, "round-timeout": 1.0})
    federation.exchange.progress_interval = 0.0
    written: list[dict[str, object]] = []
    record = repo.set_round_progress

    def spy(round_id: int, progress: dict[str, object]) -> None:
        written.append(dict(progress))
        record(round_id, progress)

    repo.set_round_progress = spy  # type: ignore[method-assign]
    federation.run()

    train = [w for w in written if w["stage"] == "train"]
    assert train[0] == {**train[0], "asked": 5, "replied": 0, "failed": 0, "waiting": 5}
    assert train[-1] == {**train[-1], "asked": 5, "replied": 3, "failed": 1, "waiting": 1}
    assert all(float(w["deadline"]) - float(w["started"]) == pytest.approx(1.0, abs=0.01) for w in train)  # type: ignore[arg-type]
    # The round row holds the last progress written while it ran; the round then completed without the silent node.
    first = repo.get_run(99).rounds[0]
    assert first.status == RoundStatus.COMPLETED and first.progress is not None and first.progress["stage"] in {"train", "evaluate"}
