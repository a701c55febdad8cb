"""Fuzzing every boundary where outside bytes enter: node replies, masking-protocol stage inputs and
wire records, run-config files and mappings, model files and stored node state.

Each property says two things: nothing but a QuorumFL refusal comes out (0 crashes), and a refused
input leaves the aggregate exactly what the honest inputs alone give (0 changed aggregates), checked
against a plain numpy reference. ``QUORUMFL_FUZZ_EXAMPLES`` sets the inputs per boundary (default 200
so the suite stays quick; the hardening note quotes a run with 10,000).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quorumfl.aggregation.secagg import MaskingParams, NodeEpoch
from quorumfl.aggregation.secagg.fixedpoint import FixedPoint
from quorumfl.errors import (
    ConfigError,
    ModelStoreError,
    QuorumError,
    SecureAggregationError,
)
from quorumfl.protocol import ckks_wire, secure_wire
from quorumfl.protocol.wire import (
    ARRAYS,
    COMPRESSION,
    METRICS,
    NODE,
    REFUSAL,
    UPDATE,
    to_array_record,
)
from quorumfl.server.config import DEFAULTS, RunConfig, load_run_config_file
from quorumfl.server.model_store import ModelStore
from quorumfl.server.replies import aggregate_train_replies
from quorumfl.server.strategies import build_strategy

from .aggregation.secagg_harness import Federation as MaskingHarness

EXAMPLES = int(os.environ.get("QUORUMFL_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])

SHAPES = {"fc.weight": (4, 3), "fc.bias": (3,)}
HONEST = {101: 10.0, 102: 25.0, 103: 40.0}
FUZZED = 999


@pytest.fixture(autouse=True)
def _flower_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower stamps every Message with the running task's identity (a ServerApp's, in production)."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 99)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def _honest_arrays(seed: int) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {n: {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for n in HONEST}


def _reply(records: RecordDict) -> Message:
    return Message(content=records, dst_node_id=0, message_type="train")


def _good(arrays: dict[str, np.ndarray], examples: float) -> Message:
    return _reply(RecordDict({ARRAYS: to_array_record(arrays),
                              METRICS: MetricRecord({"num-examples": examples, "train-loss": 0.5})}))


# ---- strategies for a hostile train reply -----------------------------------------------------
finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=20))
config_values = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True),
                          st.text(max_size=20), st.binary(max_size=40),
                          st.lists(st.integers(-2**63, 2**63 - 1), max_size=5), st.lists(st.text(max_size=5), max_size=5))
dtypes = st.sampled_from([np.float32, np.float64, np.float16, np.int8, np.int64, np.uint8, np.bool_, np.complex64])


@st.composite
def wrong_arrays(draw: st.DrawFn) -> dict[str, np.ndarray]:
    """Arrays that break the model's contract in at least one way."""
    arrays = {k: draw(hnp.arrays(np.float32, s, elements=finite)) for k, s in SHAPES.items()}
    fault = draw(st.sampled_from(["nan", "inf", "shape", "missing", "extra", "dtype", "scalar"]))
    name = draw(st.sampled_from(sorted(SHAPES)))
    if fault in ("nan", "inf"):
        flat = arrays[name].reshape(-1)
        flat[draw(st.integers(0, flat.size - 1))] = np.nan if fault == "nan" else draw(st.sampled_from([np.inf, -np.inf]))
    elif fault == "shape":
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, max_side=6).filter(lambda s: s != SHAPES[name]))
        arrays[name] = draw(hnp.arrays(np.float32, shape, elements=finite))
    elif fault == "missing":
        del arrays[name]
    elif fault == "extra":
        arrays[draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in SHAPES))] = np.zeros(2, np.float32)
    elif fault == "dtype":
        kind = draw(st.sampled_from([np.complex64, np.bool_]))
        arrays[name] = np.zeros(SHAPES[name], kind)
    else:
        arrays[name] = np.float32(draw(finite))  # type: ignore[assignment]
    return arrays


@st.composite
def hostile_reply(draw: st.DrawFn) -> Message:
    """A train reply that must be refused: bad arrays, bad metrics, a garbled compressed update, a
    refusal, raw bytes that do not decode, or records under the wrong names."""
    kind = draw(st.sampled_from(["arrays", "metrics", "compressed", "refusal", "raw-bytes", "records"]))
    good = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    metrics = MetricRecord({"num-examples": 5.0})
    if kind == "arrays":
        return _reply(RecordDict({ARRAYS: to_array_record(draw(wrong_arrays())), METRICS: metrics}))
    if kind == "metrics":
        bad = draw(st.one_of(st.just(None), st.sampled_from([0.0, -1.0, float("nan"), float("inf"), -0.0]),
                             st.floats(max_value=0.0), st.lists(st.floats(1, 100), max_size=3)))
        record = MetricRecord({"train-loss": 1.0} if bad is None else {"num-examples": bad})  # type: ignore[dict-item]
        return _reply(RecordDict({ARRAYS: to_array_record(good), METRICS: record}))
    if kind == "compressed":
        parts = draw(st.dictionaries(st.sampled_from(["gap", "val", "bits", "q", "scale", "junk"]),
                                     hnp.arrays(draw(dtypes), hnp.array_shapes(max_dims=2, max_side=20)), min_size=0, max_size=3))
        layout: dict[str, Any] = draw(st.dictionaries(
            st.sampled_from(["scheme", "fraction", "seed", "names", "val-lengths", "gap-lengths", "q-lengths"]),
            config_values, max_size=7))
        if draw(st.booleans()):
            layout.update({"scheme": draw(st.sampled_from(["topk", "randk", "int8", "none", "bogus"])),
                           "names": sorted(SHAPES), "seed": 1, "fraction": 0.5})
            for part, values in parts.items():
                layout[f"{part}-lengths"] = draw(st.lists(st.integers(-5, 40), min_size=0, max_size=3))
                del values
        record = RecordDict({UPDATE: ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in parts.items()}),
                             METRICS: metrics})
        if draw(st.booleans()):
            record[COMPRESSION] = ConfigRecord(layout)
        # at least one rule broken: no compression record, or a part that does not fit the model
        if COMPRESSION in record.config_records and not parts:
            record[COMPRESSION] = ConfigRecord({"scheme": "topk"})
        return _reply(record)
    if kind == "refusal":
        return _reply(RecordDict({ARRAYS: to_array_record(good), METRICS: metrics,
                                  REFUSAL: ConfigRecord({"reason": draw(st.text(max_size=50))})}))
    if kind == "raw-bytes":
        name = draw(st.sampled_from(sorted(SHAPES)))
        arrays = {k: Array(np.ascontiguousarray(v)) for k, v in good.items()}
        arrays[name] = Array(dtype=draw(st.sampled_from(["<f4", "<f8", "float32", "|b1", "object", "<U4", "x"])),
                             shape=tuple(draw(st.lists(st.integers(-3, 50), max_size=3))), stype="numpy.ndarray",
                             data=draw(st.binary(max_size=256)))
        return _reply(RecordDict({ARRAYS: ArrayRecord(arrays), METRICS: metrics}))
    names = draw(st.lists(st.sampled_from([ARRAYS, UPDATE, METRICS, COMPRESSION, NODE, "other"]), max_size=3, unique=True))
    records = RecordDict()
    for name in names:
        records[name] = draw(st.sampled_from([
            ConfigRecord(draw(st.dictionaries(st.text(min_size=1, max_size=10), config_values, max_size=3))),
            MetricRecord(draw(st.dictionaries(st.text(min_size=1, max_size=10), st.floats(allow_nan=True), max_size=3))),
            ArrayRecord({"x": Array(np.zeros(draw(st.integers(0, 5)), np.float32))}),
        ]))
    if ARRAYS in records.array_records and METRICS in records.metric_records and "num-examples" in records.metric_records[METRICS]:
        del records[METRICS]  # keep it invalid: an 'x'-only model must still be refused for its names
    return _reply(records)


def _reference(honest: dict[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    total = sum(HONEST.values())
    return {k: sum(HONEST[n] * honest[n][k].astype(np.float64) for n in HONEST) / total for k in SHAPES}


@FUZZ
@given(reply=hostile_reply(), seed=st.integers(0, 2**16), position=st.integers(0, 3))
def test_hostile_train_replies_are_refused_and_leave_the_aggregate_unchanged(reply: Message, seed: int, position: int) -> None:
    honest = _honest_arrays(seed)
    replies = [(n, _good(honest[n], w)) for n, w in HONEST.items()]
    replies.insert(position, (FUZZED, reply))
    config = RunConfig.from_mapping({"strategy": "fedavg", "secure-aggregation": "none", "min-nodes": 1, "max-reply-mb": 1.0})
    failures: dict[int, tuple[str, str]] = {}
    template = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}

    phase = aggregate_train_replies(build_strategy(config), 1, [template], replies, failures, max_reply_mb=1.0)

    assert FUZZED in failures and failures[FUZZED][1], "the refusal must carry a reason"
    assert sorted(phase.accepted) == sorted(HONEST)
    assert phase.arrays is not None
    for k, expected in _reference(honest).items():
        np.testing.assert_allclose(phase.arrays[k], expected, rtol=1e-6, atol=1e-6)


def test_a_node_claiming_a_huge_example_count_weighs_at_most_the_cap() -> None:
    """A well-formed reply that claims 10^12 examples, to drown out the others: its weight is capped
    (secagg-max-weight, as masking caps it), so the mean equals the numpy reference with capped weights."""
    honest = _honest_arrays(3)
    loud = {k: np.full(s, 5.0, np.float32) for k, s in SHAPES.items()}
    replies = [(n, _good(honest[n], w)) for n, w in HONEST.items()] + [(FUZZED, _good(loud, 1e12))]
    config = RunConfig.from_mapping({"strategy": "fedavg", "secure-aggregation": "none", "min-nodes": 1})
    template = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    cap = 100.0
    phase = aggregate_train_replies(build_strategy(config), 1, [template], replies, {}, max_weight=cap)
    assert phase.arrays is not None
    weights = {**{n: min(w, cap) for n, w in HONEST.items()}, FUZZED: cap}
    inputs = {**honest, FUZZED: loud}
    for k in SHAPES:
        expected = sum(weights[n] * inputs[n][k].astype(np.float64) for n in weights) / sum(weights.values())
        np.testing.assert_allclose(phase.arrays[k], expected, rtol=1e-6, atol=1e-6)


def test_an_oversized_reply_is_refused_before_decoding() -> None:
    big = _reply(RecordDict({ARRAYS: ArrayRecord({"fc.weight": Array(np.zeros(2**19, np.float32))}),
                             METRICS: MetricRecord({"num-examples": 1.0})}))
    failures: dict[int, tuple[str, str]] = {}
    config = RunConfig.from_mapping({"strategy": "fedavg", "secure-aggregation": "none", "min-nodes": 1})
    template = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    aggregate_train_replies(build_strategy(config), 1, [template], [(FUZZED, big)], failures, max_reply_mb=1.0)
    assert "over max-reply-mb 1" in failures[FUZZED][1]


# ---- masking protocol: stage inputs -----------------------------------------------------------
class _Masking:
    """A masking epoch of 5 nodes (t = 3), renewed when its slots run out."""

    nodes = [(2**63 + 977 * i) % 2**64 for i in range(5)]
    harness: MaskingHarness | None = None
    used = 0

    @classmethod
    def get(cls) -> MaskingHarness:
        if cls.harness is None or cls.used >= 64:
            cls.harness, cls.used = MaskingHarness.setup(cls.nodes, MaskingParams(threshold=3, slots=64)), 0
        cls.used += 1
        return cls.harness


@FUZZ
@given(vector=st.one_of(
    hnp.arrays(dtypes, hnp.array_shapes(min_dims=0, max_dims=2, max_side=30)),
    hnp.arrays(np.uint32, st.integers(0, 40).filter(lambda n: n != 12)),
), seed=st.integers(0, 2**16))
def test_malformed_masked_inputs_are_refused_and_the_sum_is_the_honest_one(vector: np.ndarray, seed: int) -> None:
    fed = _Masking.get()
    coord = fed.coordinator
    rng = np.random.default_rng(seed)
    values = {u: rng.uniform(-3, 3, size=12) for u in coord.ready}
    hostile = coord.ready[0]
    rnd = coord.start_round([coord.ready], 12)
    for node in rnd.groups[0]:
        request = coord.mask_request(node, rnd)
        state = NodeEpoch.from_bytes(fed.states[node])
        masked = state.mask(request, values[node], rng)
        fed.states[node] = state.to_bytes()
        if node == hostile:
            with pytest.raises(SecureAggregationError):
                rnd.add_masked(node, vector)
            continue
        rnd.add_masked(node, masked)
    request, _ = rnd.unmask_request()
    for alive, _gone in request.groups:
        for node in alive:
            state = NodeEpoch.from_bytes(fed.states[node])
            rnd.add_unmask(state.unmask(request))
            fed.states[node] = state.to_bytes()
    (outcome,) = rnd.result()
    assert outcome.total is not None and hostile in outcome.dropped
    reference = np.sum([values[u] for u in outcome.survivors], axis=0)
    bound = FixedPoint(32, 8.0, len(coord.members)).error_bound
    assert np.max(np.abs(outcome.total - reference)) <= bound


records = st.dictionaries(
    st.one_of(st.sampled_from(["epoch", "slot", "share-key", "mask-keys", "bundles", "shares", "sizes", "nodes",
                               "ceremony", "digest", "transport", "key-id", "round", "masked", "seeds"]),
              st.text(min_size=1, max_size=8)),
    config_values, max_size=6)
array_records = st.dictionaries(
    st.sampled_from(["masked", "c0", "c1", "polys", "share", "reveal", "x"]),
    hnp.arrays(dtypes, hnp.array_shapes(min_dims=0, max_dims=3, max_side=8)), max_size=3)


@FUZZ
@given(values=records, arrays=array_records)
def test_protocol_wire_records_decode_or_are_refused(values: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    config = ConfigRecord(values)
    array_record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
    decoders = [
        lambda: secure_wire.decode_advertisement(config, node=7),
        lambda: secure_wire.decode_bundles(config, node=7),
        lambda: secure_wire.decode_masked(array_record, config),
        lambda: secure_wire.decode_unmask_reply(config, node=7),
        lambda: secure_wire.decode_announcement(config),
        lambda: secure_wire.decode_mask_request(config, node=7),
        lambda: secure_wire.decode_unmask_request(config),
        lambda: ckks_wire.decode_commitment(config, node=7, ceremony=b"c" * 16),
        lambda: ckks_wire.decode_reveal(config, array_record, node=7, ceremony=b"c" * 16),
        lambda: ckks_wire.decode_encrypted(array_record, config, node=1),
        lambda: ckks_wire.decode_announcement(config),
        lambda: ckks_wire.decode_train_request(config),
    ]
    for decode in decoders:
        try:
            decode()
        except QuorumError:
            pass


@FUZZ
@given(data=st.binary(max_size=600))
def test_stored_node_state_bytes_decode_or_are_refused(data: bytes) -> None:
    try:
        NodeEpoch.from_bytes(data)
    except QuorumError:
        pass


# ---- run config -------------------------------------------------------------------------------
@FUZZ
@given(values=st.dictionaries(st.one_of(st.sampled_from(sorted(DEFAULTS)), st.text(max_size=12)), scalars, max_size=8))
def test_run_config_mappings_parse_or_name_the_bad_key(values: dict[str, Any]) -> None:
    try:
        config = RunConfig.from_mapping(values)
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
        return
    assert config.num_rounds >= 1 and config.min_nodes >= 1 and config.learning_rate >= 0
    assert config.training()[1] > 0  # 0 is the task's rate: what the nodes are told is positive


@FUZZ
@given(text=st.one_of(
    st.binary(max_size=300),
    st.builds(lambda k, v: f"[run]\n{k} = {v}\n".encode(), st.sampled_from(sorted(DEFAULTS)),
              st.sampled_from(["1", "-1", "0.5", "nan", "inf", '"x"', "true", "[1,2]", "{a=1}", "1979-05-27", '"fedavg"'])),
))
def test_run_config_files_load_or_are_refused(tmp_path_factory: pytest.TempPathFactory, text: bytes) -> None:
    path = tmp_path_factory.mktemp("cfg") / "run.toml"
    path.write_bytes(text)
    try:
        load_run_config_file(path)
    except ConfigError:
        pass


# ---- model files ------------------------------------------------------------------------------
@FUZZ
@given(data=st.binary(max_size=400), flip=st.integers(0, 10_000))
def test_model_files_load_or_are_refused(tmp_path_factory: pytest.TempPathFactory, data: bytes, flip: int) -> None:
    import hashlib

    store = ModelStore(tmp_path_factory.mktemp("models"))
    stored = store.save({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "v1")
    raw = bytearray(Path(stored.path).read_bytes())
    if data:  # garbage with a matching hash (a bad file recorded as good), or one flipped byte
        Path(stored.path).write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
    else:
        raw[flip % len(raw)] ^= 0xFF
        Path(stored.path).write_bytes(bytes(raw))
        sha = stored.sha256
    try:
        arrays = store.load(stored.path, sha)
    except ModelStoreError:
        return
    assert all(isinstance(v, np.ndarray) for v in arrays.values())


def test_npz_with_pickled_objects_is_refused(tmp_path: Path) -> None:
    import hashlib

    buffer = io.BytesIO()
    np.savez(buffer, w=np.array([{"a": 1}], dtype=object))
    path = tmp_path / "evil.npz"
    path.write_bytes(buffer.getvalue())
    with pytest.raises(ModelStoreError):
        ModelStore(tmp_path).load(path, hashlib.sha256(buffer.getvalue()).hexdigest())


# ---- node-side decoders against non-finite and huge numbers ----------------------------------------
HOSTILE_NUMBERS = [float("inf"), float("-inf"), float("nan"), 1e308, -1e308, 2**63, 2**64, -(2**63) - 1, 10**30,
                   2**31, -(2**31) - 1, 2**32, -1, 0, 1.5, -0.0, True]
HOSTILE_JSON = ["1e400", "-1e400", "NaN", "Infinity", str(2**70), "1.5", "-1", "true", "null", "[" * 5000, "{}"]


def _node_side_records() -> dict[str, tuple[ConfigRecord, Any]]:
    """A valid record for each decoder a node runs on what the server sends, and how the node then
    uses what it decoded (the arithmetic and byte packing a bad number could break)."""
    from quorumfl.aggregation.ckks import Announcement, CkksParams, Manifest
    from quorumfl.aggregation.ckks.threshold import NONCE_BYTES, contribution_message
    from quorumfl.aggregation.secagg import EpochAnnouncement, MaskRequest, UnmaskRequest
    from quorumfl.aggregation.secagg.identity import view_message
    from quorumfl.aggregation.secagg.messages import announcement_terms

    ids = (11, 12, 13)
    masking = EpochAnnouncement(b"e" * 16, ids, MaskingParams(threshold=2, slots=3))
    ckks_params = CkksParams()
    manifest = Manifest("k" * 32, 3, 0, b"n" * NONCE_BYTES, ids, ids[:2], 4000, 2)
    request = ckks_wire.TrainRequest(key_id="k" * 32, public_key=b"p", params=ckks_params, primes=2, clip=8.0,
                                     max_weight=100.0, round_number=3, participants=ids, nonce=b"n" * NONCE_BYTES)

    def use_announcement(ann: EpochAnnouncement) -> None:
        ann.params.check(len(ann.cohort))
        announcement_terms(ann.params, ann.cohort)

    def use_manifest(decoded: tuple[Manifest, list[Any]]) -> None:
        m = decoded[0]
        contribution_message(binding=b"run:1", key_id=m.key_id, round_number=m.round, group=m.group, nonce=m.nonce,
                             length=m.length, primes=m.primes, node=ids[0], department="d", digest=b"x" * 32)

    def use_train_request(r: ckks_wire.TrainRequest) -> None:
        contribution_message(binding=b"run:1", key_id=r.key_id, round_number=r.round_number, group=r.group,
                             nonce=r.nonce, length=10, primes=r.primes, node=ids[0], department="d", digest=b"x" * 32)

    from quorumfl.protocol.wire import TrainConfig

    train = TrainConfig(server_round=3, model="mlp", local_epochs=1, batch_size=32, learning_rate=0.05,
                        proximal_mu=0.1, seed=0)
    return {
        "train config": (train.to_record(), TrainConfig.from_record),
        "masking announcement": (secure_wire.encode_announcement(masking),
                                 lambda rec: use_announcement(secure_wire.decode_announcement(rec))),
        "mask request": (secure_wire.encode_mask_request(MaskRequest(b"e" * 16, 1, ids), max_weight=10.0),
                         lambda rec: secure_wire.decode_mask_request(rec, node=11)),
        "unmask request": (secure_wire.encode_unmask_request(UnmaskRequest(b"e" * 16, 1, ((ids[:2], ids[2:]),))),
                           lambda rec: (lambda u: view_message(binding=b"run:1", epoch=u.epoch, slot=u.slot,
                                                               view=u.view()))(secure_wire.decode_unmask_request(rec))),
        "ckks announcement": (ckks_wire.encode_announcement(Announcement.new(ids, 2, ckks_params), run_id=2**64 - 5),
                              lambda rec: ckks_wire.decode_announcement(rec)[0].terms()),
        "ckks train request": (ckks_wire.encode_train_request(request),
                               lambda rec: use_train_request(ckks_wire.decode_train_request(rec))),
        "decrypt request": (ckks_wire.encode_decrypt_request(manifest, {}),
                            lambda rec: use_manifest(ckks_wire.decode_decrypt_request(rec))),
    }


NODE_SIDE = _node_side_records()


@st.composite
def hostile_number_record(draw: st.DrawFn, name: str) -> ConfigRecord:
    """``name``'s valid record with one number (a top-level field, or one inside a JSON field) made
    non-finite, huge, negative or of the wrong kind."""
    import json

    base = dict(NODE_SIDE[name][0])
    fields = sorted(k for k, v in base.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    nested = sorted(k for k, v in base.items() if isinstance(v, str) and v.startswith("{"))
    key = draw(st.sampled_from(fields + nested))
    if key in nested:
        inner = json.loads(base[key])
        field = draw(st.sampled_from(sorted(inner)))
        text = json.dumps({**inner, field: "HOSTILE"})
        literal = draw(st.one_of(st.sampled_from(HOSTILE_JSON), st.floats(allow_nan=True).map(json.dumps),
                                 st.integers(-(2**80), 2**80).map(str)))
        base[key] = text.replace('"HOSTILE"', literal)
    else:
        base[key] = draw(st.one_of(st.sampled_from(HOSTILE_NUMBERS), st.floats(allow_nan=True),
                                   st.integers(-(2**70), 2**70)))
    return ConfigRecord(base)


@pytest.mark.parametrize("name", sorted(NODE_SIDE))
def test_node_side_decoders_refuse_non_finite_and_huge_numbers_cleanly(name: str) -> None:
    """Every node-side decoder, and the node's first use of what it decoded, on records with one
    hostile number: it decodes to something usable or raises a QuorumFL error, never another exception."""
    outcomes = {"refused": 0, "decoded": 0}

    @FUZZ
    @given(record=hostile_number_record(name))
    def check(record: ConfigRecord) -> None:
        try:
            NODE_SIDE[name][1](record)
        except QuorumError:
            outcomes["refused"] += 1
        else:
            outcomes["decoded"] += 1

    NODE_SIDE[name][1](NODE_SIDE[name][0])  # the valid record decodes (a Flower run id is unsigned 64-bit)
    check()
    print(f"{name}: {outcomes['refused']} refused, {outcomes['decoded']} decoded, 0 other exceptions")
    assert outcomes["refused"] > 0  # the hostile numbers do reach the checks
