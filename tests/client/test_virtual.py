"""The ClientApp mod that makes a simulated node a department: what it maps, and that it never
touches a deployed SuperNode's node config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict

from quorumfl.client.virtual import (
    AVAILABILITY_KEY,
    DROPOUT_KEY,
    PAYLOAD_LOG_KEY,
    SEED_KEY,
    SIMULATION_ROOT_ENV,
    SPEED_KEY,
    START_KEY,
    drops,
    offline,
    record_payload,
    slowdown,
    virtual_department,
    virtual_node_config,
    write_layout,
)
from quorumfl.core.data.departments import propose_schema
from quorumfl.deploy.simulation import (
    SimulationSettings,
    department_speeds,
    simulate,
    virtual_departments,
)
from quorumfl.errors import ConfigError
from tests.core.city_data import property_rows, write_csv


@pytest.fixture(autouse=True)
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's Message needs the task's identity that a ClientApp process has."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 7)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def _seen(root: Path, node_config: dict[str, bool | int | float | str], monkeypatch: pytest.MonkeyPatch,
          *, env: bool = True) -> dict[str, bool | int | float | str]:
    if env:
        monkeypatch.setenv(SIMULATION_ROOT_ENV, str(root))
    else:
        monkeypatch.delenv(SIMULATION_ROOT_ENV, raising=False)
    context = Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})
    seen: dict[str, bool | int | float | str] = {}

    def handler(msg: Message, ctx: Context) -> Message:
        seen.update(ctx.node_config)
        return msg

    virtual_department(Message(RecordDict(), dst_node_id=7, message_type="train"), context, handler)
    return seen


def test_a_virtual_node_gets_its_departments_partition_name_and_state_folder(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "sim"
    write_layout(root, [("tax-office", tmp_path / "a"), ("parks", tmp_path / "b")], {"reproducible-training": True})
    seen = _seen(root, {"partition-id": 1, "num-partitions": 2}, monkeypatch)
    assert seen == {"partition-id": 1, "num-partitions": 2, "data-path": str(tmp_path / "b"), "department": "parks",
                    "state-dir": str(root / "nodes" / "parks"), "torch-threads": 1, "reproducible-training": True,
                    "virtual-root": str(root)}


def test_a_deployed_node_config_is_never_remapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "sim"
    write_layout(root, [("tax-office", tmp_path / "a")], {})
    deployed = {"partition-id": 0, "data-path": "/srv/tax", "department": "tax-office"}
    assert _seen(root, dict(deployed), monkeypatch) == deployed  # it has its own data-path
    other = {**deployed, "virtual-root": str(tmp_path / "another")}
    assert _seen(root, dict(other), monkeypatch) == other  # mapped from another simulation folder, if any
    assert _seen(root, {"partition-id": 0}, monkeypatch, env=False) == {"partition-id": 0}  # not a simulation


def test_a_partition_id_outside_the_simulation_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "sim"
    write_layout(root, [("tax-office", tmp_path / "a")], {})
    with pytest.raises(ConfigError, match="partition-id 1; the simulation has 1 departments"):
        virtual_node_config({"partition-id": 1}, str(root))
    with pytest.raises(ConfigError, match="no readable simulation.json"):
        virtual_node_config({"partition-id": 0}, str(tmp_path / "elsewhere"))


def test_virtual_department_names_sort_in_partition_order() -> None:
    names = virtual_departments(10_001)
    assert names[:2] == ["dept-00000", "dept-00001"] and names == sorted(names) and len(set(names)) == 10_001


def test_bad_simulation_settings_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--departments must be at least 1"):
        SimulationSettings(departments=0, root=tmp_path)
    parts = tmp_path / "parts"
    (parts / "only-one").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"--data .* holds 1 partition folder\(s\), --departments asks for 3"):
        simulate({}, SimulationSettings(departments=3, root=tmp_path / "sim", data=parts), repo=None)  # type: ignore[arg-type]
    assert not (tmp_path / "sim").exists()  # nothing left behind
    schema = propose_schema(write_csv(tmp_path / "s.csv", property_rows(20, seed=1)), "tabular",
                            {"label": "sale_price", "ignore": "parcel"})
    with pytest.raises(ConfigError, match="task 'tabular': pass --data DIR"):
        simulate({"task": "tabular", "task-schema": json.dumps(schema)}, SimulationSettings(departments=3, root=tmp_path / "sim"), repo=None)  # type: ignore[arg-type]


def test_without_ray_simulate_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs Flower's simulation engine \(Ray\).*setup.sh --simulation"):
        simulate({}, SimulationSettings(departments=2, root=tmp_path / "sim"), repo=None)  # type: ignore[arg-type]


def test_dropouts_are_drawn_per_message_at_the_asked_rate_and_repeat_for_the_same_message() -> None:
    config: dict[str, bool | int | float | str] = {"department": "parks", DROPOUT_KEY: 0.1, SEED_KEY: 3}
    draws = [drops(config, f"message-{i}") for i in range(5000)]
    assert 0.08 < sum(draws) / len(draws) < 0.12  # binomial(5000, 0.1): sd 0.004
    assert draws == [drops(config, f"message-{i}") for i in range(5000)]  # a message's fate is fixed
    other = [drops({**config, "department": "tax-office"}, f"message-{i}") for i in range(5000)]
    assert draws != other  # departments drop independently
    assert not any(drops({**config, DROPOUT_KEY: 0.0}, f"message-{i}") for i in range(1000))
    with pytest.raises(ConfigError, match="virtual-dropout must be a probability"):
        drops({**config, DROPOUT_KEY: 1.0}, "m")


def test_a_virtual_department_that_drops_out_answers_with_an_error(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "sim"
    write_layout(root, [("parks", tmp_path / "a")], {DROPOUT_KEY: 0.999999})
    monkeypatch.setenv(SIMULATION_ROOT_ENV, str(root))
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})

    def handler(msg: Message, ctx: Context) -> Message:
        raise AssertionError("a department that dropped out does not train")

    reply = virtual_department(Message(RecordDict(), dst_node_id=7, message_type="train"), context, handler)
    assert reply.has_error() and reply.error.reason == ("virtual department parks dropped out of this train message "
                                                        "(virtual-dropout)")


def test_a_virtual_department_drops_out_of_later_messages_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulated node keeps its Context (and the config the mod mapped) between messages; the mod
    still plays dropouts on every message, not only on the first (the key set-up's)."""
    root = tmp_path / "sim"
    write_layout(root, [("parks", tmp_path / "a")], {DROPOUT_KEY: 0.999999})
    monkeypatch.setenv(SIMULATION_ROOT_ENV, str(root))
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    handled: list[str] = []

    def handler(msg: Message, ctx: Context) -> Message:
        handled.append(msg.metadata.message_type)
        return msg

    for kind in ("query.secagg_advertise", "query.secagg_share", "train", "query.secagg_unmask"):
        reply = virtual_department(Message(RecordDict(), dst_node_id=7, message_type=kind), context, handler)
        assert reply.has_error() and f"dropped out of this {kind} message" in reply.error.reason
    assert handled == []
    assert context.node_config["department"] == "parks" and context.node_config["data-path"] == str(tmp_path / "a")


def test_only_a_virtual_department_writes_its_payload_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``virtual-payload-log`` is a rehearsal's audit: a node config the simulation mod did not map (a
    deployed SuperNode's, even with the key set by hand, or one mapped from another simulation folder)
    writes nothing."""
    root = tmp_path / "sim"
    log = tmp_path / "log"
    write_layout(root, [("parks", tmp_path / "a")], {PAYLOAD_LOG_KEY: str(log)})
    payload, received = np.arange(5.0), {"b": np.ones(2, dtype=np.float32), "a": np.zeros(1)}
    monkeypatch.setenv(SIMULATION_ROOT_ENV, str(root))
    deployed = {"partition-id": 0, "data-path": "/srv/parks", "department": "parks", PAYLOAD_LOG_KEY: str(log)}
    record_payload(deployed, round_number=1, node=7, received=received, payload=payload)
    other = {**virtual_node_config({"partition-id": 0}, str(root)), "virtual-root": str(tmp_path / "another")}
    record_payload(other, round_number=1, node=7, received=received, payload=payload)
    assert not log.exists()
    mapped = virtual_node_config({"partition-id": 0}, str(root))
    monkeypatch.delenv(SIMULATION_ROOT_ENV)
    record_payload(mapped, round_number=1, node=7, received=received, payload=payload)  # outside a simulation
    assert not log.exists()
    monkeypatch.setenv(SIMULATION_ROOT_ENV, str(root))
    record_payload(mapped, round_number=3, node=7, received=received, payload=payload)
    with np.load(log / "round-0003-node-7.npz") as saved:
        assert np.array_equal(saved["payload"], payload)
        assert np.array_equal(saved["received"], [0.0, 1.0, 1.0])  # flattened in key order, as the payload is


def test_lognormal_speeds_follow_the_runs_seed_with_median_one_capped_at_this_machines_speed() -> None:
    names = virtual_departments(4000)
    speeds = department_speeds("lognormal:1", names, seed=5)
    assert speeds is not None and len(speeds) == 4000 and all(0.0 < s <= 1.0 for s in speeds)
    assert speeds == department_speeds("lognormal:1", names, seed=5)  # the same rehearsal twice
    assert speeds != department_speeds("lognormal:1", names, seed=6)
    # log-normal, median 1, σ = 1: half at this machine's speed; P(S < 0.5) = Φ(ln 0.5) = 0.244; sd ~0.007
    assert 0.46 < sum(s == 1.0 for s in speeds) / 4000 < 0.54
    assert 0.22 < sum(s < 0.5 for s in speeds) / 4000 < 0.27
    assert department_speeds("", names, seed=5) is None


def test_a_speeds_file_names_departments_and_the_rest_run_at_this_machines_speed(tmp_path: Path) -> None:
    names = ["parks", "tax-office", "transit"]
    path = tmp_path / "speeds.json"
    path.write_text(json.dumps({"tax-office": 0.25}))
    assert department_speeds(str(path), names, seed=0) == [1.0, 0.25, 1.0]
    for body, message in (({"taxes": 0.5}, "no department named 'taxes'"),
                          ({"parks": 0}, "'parks' has speed 0; a speed is a factor in \\(0, 1\\]"),
                          ({"parks": 2.0}, "'parks' has speed 2.0"), ({"parks": True}, "'parks' has speed True"),
                          ([0.5], "one JSON object")):
        path.write_text(json.dumps(body))
        with pytest.raises(ConfigError, match=message):
            department_speeds(str(path), names, seed=0)
    for spec, message in (("lognormal:0", "σ must be a number in"), ("lognormal:x", "σ must be a number in"),
                          ("lognormal:9", "σ must be a number in"), (str(tmp_path / "none.json"), "not a readable")):
        with pytest.raises(ConfigError, match=message):
            department_speeds(spec, names, seed=0)


def test_a_slow_virtual_department_gets_its_speed_and_its_reply_waits_for_it(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "sim"
    write_layout(root, [("parks", tmp_path / "a"), ("transit", tmp_path / "b")], {}, speeds=[1.0, 0.25])
    assert SPEED_KEY not in virtual_node_config({"partition-id": 0}, str(root))
    assert virtual_node_config({"partition-id": 1}, str(root))[SPEED_KEY] == 0.25
    with pytest.raises(ConfigError, match="2 speed"):
        write_layout(tmp_path / "other", [("parks", tmp_path / "a")], {}, speeds=[1.0, 0.5])

    class Clock:  # the mod's clock and sleep: handling takes 2 s of this clock
        def __init__(self) -> None:
            self.now = 100.0
            self.slept: list[float] = []

        def monotonic(self) -> float:
            return self.now

        def time(self) -> float:
            return self.now

        def sleep(self, seconds: float) -> None:
            self.slept.append(seconds)

    clock = Clock()
    monkeypatch.setattr("quorumfl.client.virtual.time", clock)
    monkeypatch.setenv(SIMULATION_ROOT_ENV, str(root))

    def handler(msg: Message, ctx: Context) -> Message:
        clock.now += 2.0
        return msg

    for partition in (0, 1):
        context = Context(run_id=1, node_id=7, node_config={"partition-id": partition}, state=RecordDict(),
                          run_config={})
        virtual_department(Message(RecordDict(), dst_node_id=7, message_type="train"), context, handler)
    assert clock.slept == [6.0]  # transit, a quarter as fast: 2 s of work leaves after 8 s; parks does not wait
    assert slowdown({}, 3.0) == 0.0
    with pytest.raises(ConfigError, match="virtual-speed must be a speed factor"):
        slowdown({SPEED_KEY: 0.0}, 1.0)


def test_availability_takes_each_department_offline_a_quarter_of_its_period_at_a_phase_of_its_own() -> None:
    config: dict[str, bool | int | float | str] = {"department": "parks", SEED_KEY: 3, AVAILABILITY_KEY: 100.0,
                                                   START_KEY: 1000.0}
    times = [1000.0 + 0.5 * i for i in range(2000)]  # ten periods
    parks = [offline(config, t) for t in times]
    assert sum(parks) == 500  # exactly a quarter of every period
    assert parks[:200] == parks[200:400]  # the same window every period
    changes = sum(a != b for a, b in zip(parks, parks[1:], strict=False))
    assert changes in (19, 20)  # one window per period: it goes offline and back once each
    transit = [offline({**config, "department": "transit"}, t) for t in times]
    assert sum(transit) == 500 and transit != parks  # another phase
    assert not any(offline({**config, AVAILABILITY_KEY: 0.0}, t) for t in times)
    with pytest.raises(ConfigError, match="virtual-availability must be a period"):
        offline({**config, AVAILABILITY_KEY: -1.0}, 0.0)


def test_an_offline_virtual_department_answers_with_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "sim"
    write_layout(root, [("parks", tmp_path / "a")], {AVAILABILITY_KEY: 100.0, START_KEY: 0.0, SEED_KEY: 3})
    monkeypatch.setenv(SIMULATION_ROOT_ENV, str(root))
    node = virtual_node_config({"partition-id": 0}, str(root))
    away = next(t for t in range(100) if offline(node, float(t)))
    here = next(t for t in range(100) if not offline(node, float(t)))
    handled: list[float] = []

    def handler(msg: Message, ctx: Context) -> Message:
        handled.append(1.0)
        return msg

    replies = {}
    for now in (away, here):
        monkeypatch.setattr("quorumfl.client.virtual.time.time", lambda now=now: float(now))
        context = Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
        replies[now] = virtual_department(Message(RecordDict(), dst_node_id=7, message_type="train"), context, handler)
    assert replies[away].has_error() and replies[away].error.reason == ("virtual department parks is offline "
                                                                        "(virtual-availability)")
    assert not replies[here].has_error() and handled == [1.0]
    with pytest.raises(ConfigError, match="--availability must be a period"):
        SimulationSettings(departments=2, root=tmp_path / "x", availability=-5.0)


class _Metadata:
    def __init__(self, node: int, created: float) -> None:
        self.dst_node_id, self.delivered_at, self.created = node, "", created


class _Message:
    def __init__(self, node: int, created: float = 0.0) -> None:
        self.metadata = _Metadata(node, created)


class _LinkState:
    """What the dispatcher reads of Flower's InMemoryLinkState: its lock, its store and its own validity check
    (here: a message created before time 0 has expired)."""

    def __init__(self, messages: dict[str, _Message]) -> None:
        import threading

        self.lock = threading.RLock()
        self.message_ins_store = messages
        self.checked: list[set[str]] = []

    def _check_stored_messages(self, ids: set[str]) -> None:
        self.checked.append(set(ids))
        for msg_id in ids:
            if self.message_ins_store[msg_id].metadata.created < 0:
                del self.message_ins_store[msg_id]


def test_one_pass_dispatch_queues_each_nodes_first_undelivered_message_as_flowers_loop_does() -> None:
    import queue
    import threading

    from quorumfl.deploy.sim_dispatch import add_messages_in_one_pass

    messages = {"a1": _Message(1), "b1": _Message(2), "a2": _Message(1), "gone": _Message(3, created=-1.0),
                "other": _Message(99), "c1": _Message(3)}
    messages["b1"].metadata.delivered_at = "earlier"  # already with its worker
    state, out, stop = _LinkState(messages), queue.Queue(), threading.Event()

    class _OnePass(queue.Queue):  # type: ignore[type-arg]
        def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
            out.put(item)
            stop.set()

    add_messages_in_one_pass(state, _OnePass(), {1: 0, 2: 1, 3: 2}, stop)
    queued = [out.get_nowait() for _ in range(out.qsize())]
    assert queued == [messages["a1"], messages["c1"]]  # node 1's first, node 3's; node 2's is delivered
    assert messages["a1"].metadata.delivered_at and not messages["a2"].metadata.delivered_at
    assert "gone" not in state.message_ins_store and not messages["other"].metadata.delivered_at  # not our node
    assert state.checked == [{"a1", "b1", "a2", "gone", "other", "c1"}]  # one validity pass, not one per node
