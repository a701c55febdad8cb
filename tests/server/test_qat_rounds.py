"""Federated QAT (``qat-rounds``) through the federation loop and the real ClientApp handlers (in-process
Grid): the last rounds fine-tune with fake quantisation on every department, and what their observers
saw comes back as arrays that the server averages with the model, in plaintext and under masking."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from quorumfl.aggregation.secagg.payload import HEADER, flatten, unflatten
from quorumfl.client import secure
from quorumfl.core.data import prepare_partitions
from quorumfl.core.data.store import read_partition
from quorumfl.core.models import QAT_PREFIX, split_control
from quorumfl.errors import ConfigError
from quorumfl.protocol.wire import ARRAYS, METRICS, from_array_record
from quorumfl.server.config import RunConfig
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.repository import RunStatus
from quorumfl.training.qat import RANGE_DIVISOR, decode_ranges

from .test_clustered_rounds import _contexts as _repeatable
from .test_rounds import (
    LoopbackGrid,
    _contexts,
    _federation,
    task_identity,  # noqa: F401  (an autouse fixture)
)

# plain averaging (no server momentum): the stored model is the mean of what the departments sent
RUN = {"num-rounds": 2, "qat-rounds": 1, "local-epochs": 1, "batch-size": 32, "learning-rate": 0.05, "seed": 5,
       "server-momentum": 0.0}


@pytest.fixture
def three_parts(tmp_path: Path) -> dict[str, Path]:
    return prepare_partitions(tmp_path / "data", ["tax-office", "parks", "libraries"], seed=1, method="dirichlet",
                              alpha=0.5)


def _versions(repo: object, run_id: int) -> list[dict[str, np.ndarray]]:
    return [ModelStore.load(v.path, v.sha256) for v in repo.list_model_versions(run_id=run_id)]  # type: ignore[attr-defined]


@pytest.mark.slow  # ~20 s: the default suite keeps the unit tests (tests/edge/test_federated_qat.py)
def test_the_last_round_fine_tunes_with_fake_quantisation_and_averages_the_departments_ranges(
    tmp_path: Path, three_parts: dict[str, Path]
) -> None:
    grid = LoopbackGrid(_contexts(three_parts))
    fed, repo = _federation(tmp_path, grid, **RUN)
    run_id = fed.run()
    assert repo.get_run(run_id).status == RunStatus.COMPLETED, repo.get_run(run_id).error
    first, last = _versions(repo, run_id)
    assert not any(k.startswith(QAT_PREFIX) for k in first)  # round 1 trained plainly
    stored = decode_ranges(last)
    assert stored and set(last) == set(split_control(last)[0]) | {QAT_PREFIX + n for n in stored}

    replies = [r for r in grid.replies if r.metadata.message_type == "train" and
               r.content.metric_records[METRICS].get("qat-round") == 1.0]
    assert len(replies) == 3  # every department fine-tuned with fake quantisation in round 2
    weights = np.array([r.content.metric_records[METRICS]["num-examples"] for r in replies], dtype=np.float64)
    sent = [from_array_record(r.content.array_records[ARRAYS]) for r in replies]
    for key, value in last.items():  # the numpy reference: the example-weighted mean of what came back
        stack = np.stack([s[key] for s in sent]).astype(np.float64)
        np.testing.assert_allclose(value, np.tensordot(weights / weights.sum(), stack, axes=1), rtol=1e-5,
                                   atol=1e-6, err_msg=key)
    # what a department sent is what its observers saw: the input quantiser's range lies within its data's
    first_observer = min(stored, key=lambda n: int(n.rsplit("_", 1)[1]))
    for s, part in zip(sent, three_parts.values(), strict=True):
        low, high = decode_ranges({QAT_PREFIX + first_observer: s[QAT_PREFIX + first_observer]})[first_observer]
        x = read_partition(part).train.x
        assert float(x.min()) - 1e-5 <= low < high <= float(x.max()) + 1e-5
    low, high = stored[first_observer]  # ...and the federation's is their mean in asinh space
    encoded = [np.sinh(RANGE_DIVISOR * np.float64(s[QAT_PREFIX + first_observer][1])) for s in sent]
    assert min(encoded) - 1e-4 <= high <= max(encoded) + 1e-4


@pytest.mark.slow
def test_masked_qat_rounds_give_the_plaintext_model_and_ranges(tmp_path: Path, three_parts: dict[str, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Round by round, against plain numpy: masking's only error is the fixed-point encoding's
    (``FixedPoint.error_bound``, ~1e-8 here). Round 1 starts both runs from the same model with the same
    repeatable training, so its masked model is the plaintext run's. Round 2 (fake quantisation) starts
    from round 1's masked model, which differs by that encoding error: a fake-quantised activation can then
    round the other way and the departments' training diverges (1e-5 to 1.7e-3 per weight in repeated runs),
    so round 2 is checked against what the departments of the masked run fed the secure sum."""
    fed: dict[int, list[tuple[dict[str, np.ndarray], np.ndarray]]] = {}
    original = secure.record_payload

    def spy(node_config: dict[str, object], *, round_number: int, node: int, received: dict[str, np.ndarray],
            payload: np.ndarray) -> None:
        fed.setdefault(round_number, []).append(({k: np.array(v) for k, v in received.items()}, payload.copy()))
        original(node_config, round_number=round_number, node=node, received=received, payload=payload)

    plain, repo = _federation(tmp_path, LoopbackGrid(_repeatable(three_parts, tmp_path / "plain")), **RUN)
    plain_run = plain.run()
    monkeypatch.setattr(secure, "record_payload", spy)
    masked, repo = _federation(tmp_path, LoopbackGrid(_repeatable(three_parts, tmp_path / "masked")), **RUN,
                               **{"secure-aggregation": "masking", "secagg-threshold": 2})
    masked_run = masked.run()
    assert repo.get_run(masked_run).status == RunStatus.COMPLETED, repo.get_run(masked_run).error
    (plain_first, plain_last), (first, last) = _versions(repo, plain_run), _versions(repo, masked_run)
    assert set(last) == set(plain_last) and any(k.startswith(QAT_PREFIX) for k in last)
    atol = 1e-6  # the encoding's bound divided by the total weight, and float32 storage
    for key, value in first.items():
        np.testing.assert_allclose(value, plain_first[key], rtol=0, atol=atol, err_msg=key)

    assert len(fed[2]) == 3  # every department fed round 2's secure sum
    received = fed[2][0][0]
    assert all(flatten(r).tobytes() == flatten(received).tobytes() for r, _ in fed[2])
    for key, value in first.items():  # round 2 started from round 1's masked model (and fresh ranges)
        np.testing.assert_array_equal(received[key], value, err_msg=key)
    total = np.sum([p for _, p in fed[2]], axis=0)
    mean = flatten(received) + total[HEADER:] / total[0]  # the weighted mean of w·δ over Σw
    for key, value in unflatten(mean, received).items():
        np.testing.assert_allclose(last[key], value, rtol=0, atol=atol, err_msg=key)
    for key, value in last.items():  # the ranges the observers saw are the plaintext run's, up to that divergence
        if key.startswith(QAT_PREFIX):
            np.testing.assert_allclose(value, plain_last[key], rtol=0, atol=1e-3, err_msg=key)


def test_qat_rounds_refuse_what_they_do_not_combine_with() -> None:
    for overrides, words in [
        ({"qat-rounds": 2, "num-rounds": 2}, "must be below num-rounds"),
        ({"qat-rounds": 1, "strategy": "scaffold"}, "fedavg or fedprox"),
        ({"qat-rounds": 1, "dp": "local", "dp-noise-multiplier": 1.0, "model": "mlp-tanh"}, "with dp"),
        ({"qat-rounds": 1, "compression": "int8"}, "with compression"),
        ({"qat-rounds": 1, "secure-aggregation": "masking", "secagg-clip": 0.5}, "secagg-clip >= 1"),
    ]:
        with pytest.raises(ConfigError, match=words):
            RunConfig.from_mapping({"num-rounds": 3, **overrides})


@pytest.mark.slow
def test_ckks_qat_rounds_give_the_plaintext_model_and_ranges(tmp_path: Path, three_parts: dict[str, Path]) -> None:
    from .test_rounds import REPRODUCIBLE

    plain, repo = _federation(tmp_path, LoopbackGrid(_contexts(three_parts, REPRODUCIBLE)), **RUN)
    plain_run = plain.run()
    ckks, repo = _federation(tmp_path, LoopbackGrid(_contexts(three_parts, REPRODUCIBLE)), **RUN,
                             **{"secure-aggregation": "ckks", "secagg-threshold": 0.6})
    ckks_run = ckks.run()
    assert repo.get_run(ckks_run).status == RunStatus.COMPLETED, repo.get_run(ckks_run).error
    (plain_1, reference), (ckks_1, stored) = _versions(repo, plain_run), _versions(repo, ckks_run)
    assert set(stored) == set(reference) and any(k.startswith(QAT_PREFIX) for k in stored)
    for key, value in ckks_1.items():  # round 1 (plain training): the CKKS mean is the plaintext mean
        np.testing.assert_allclose(value, plain_1[key], rtol=0, atol=1e-6, err_msg=key)
    # Round 2 trains from round 1's CKKS model, ~3e-8 from the plaintext one per coordinate; usually it
    # ends ~1e-6 away, but that error can move a fake-quantised activation across a rounding boundary
    # in one batch, which then moves a few of the model's values by up to a few 1e-3 (seen: 2.9e-3).
    for key, value in stored.items():
        np.testing.assert_allclose(value, reference[key], rtol=0, atol=1e-2, err_msg=key)


def test_a_node_refuses_a_qat_round_it_cannot_check(three_parts: dict[str, Path]) -> None:
    """A server that asks for a QAT round beside DP-SGD, or sends no ranges with the model: the node
    refuses before training, naming why (it fails closed whatever the server's config says)."""
    from dataclasses import replace

    from quorumfl.client.node_round import train_round
    from quorumfl.core.models import build_model, model_to_arrays
    from quorumfl.protocol.wire import TrainConfig
    from quorumfl.training.qat import range_template

    part = read_partition(next(iter(three_parts.values())))
    model = build_model("mlp", part.train.input_shape, 10, seed=0)
    arrays = model_to_arrays(model)
    config = TrainConfig(server_round=2, model="mlp", local_epochs=1, batch_size=32, learning_rate=0.05,
                         proximal_mu=0.0, seed=0, qat=True)
    with pytest.raises(ConfigError, match="sent no activation ranges"):
        train_round(config, [arrays], None, part.train, part.test)
    with_ranges = {**arrays, **range_template(model, part.train.input_shape)}
    with pytest.raises(ConfigError, match="without dp or compression"):
        train_round(replace(config, dp="distributed"), [with_ranges], None, part.train, part.test)
