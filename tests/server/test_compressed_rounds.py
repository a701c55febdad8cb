"""Compressed updates through the federation loop and the real ClientApp handlers (in-process Grid).

Reference: the stored model of each round equals the previous model plus the example-weighted numpy
mean of the updates written out from each reply's raw parts (top-k: scatter float16 values at the
sent indices). Bytes per node per round are read back from the state DB.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from quorumfl.client.personal_store import PersonalStore
from quorumfl.core.data import prepare_partitions
from quorumfl.errors import ConfigError
from quorumfl.protocol.wire import ARRAYS, COMPRESSION, METRICS, UPDATE
from quorumfl.server.config import RunConfig
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.repository import RunStatus

from .test_rounds import REPRODUCIBLE, LoopbackGrid, _federation, task_identity  # noqa: F401  (an autouse fixture)


def _contexts(tmp_path: Path) -> dict[int, Context]:
    parts = prepare_partitions(tmp_path / "data", ["tax-office", "urban-planning", "housing"], seed=0, method="iid")
    return {  # repeatable training (REPRODUCIBLE): masked runs are compared with plaintext ones
        1000 + i: Context(run_id=99, node_id=1000 + i,
                          node_config={"data-path": str(p), "department": name, "state-dir": str(tmp_path / name),
                                       **REPRODUCIBLE},
                          state=RecordDict(), run_config={})
        for i, (name, p) in enumerate(parts.items())
    }


def _round_models(repo: object, run_id: int) -> dict[int, dict[str, np.ndarray]]:
    return {v.round: ModelStore.load(v.path, v.sha256)
            for v in repo.list_model_versions(run_id=run_id)}  # type: ignore[attr-defined]


def _topk_delta(reply: object, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    record = reply.content.array_records[UPDATE]  # type: ignore[attr-defined]
    layout = reply.content.config_records[COMPRESSION]  # type: ignore[attr-defined]
    gap_array = record["gap"].numpy()
    skip = int(np.iinfo(gap_array.dtype).max)  # uint8 or uint16 words; the largest one skips that many
    gaps, val = gap_array.tolist(), record["val"].numpy().astype(np.float64)
    out, word, at = {}, 0, 0
    for name, words in zip(layout["names"], layout["gap-lengths"], strict=True):
        flat = np.zeros(int(np.prod(shapes[name])), np.float64)
        position = 0  # a plain reading of the gap code: `skip` skips that many entries, any other g skips g
        for g in gaps[word : word + words]:
            if g == skip:
                position += skip
            else:
                flat[position + g] = val[at]
                position, at = position + g + 1, at + 1
        out[name] = flat.reshape(shapes[name])
        word += words
    return out


def test_topk_rounds_average_the_decoded_updates_and_record_bytes(tmp_path: Path) -> None:
    contexts = _contexts(tmp_path)
    grid = LoopbackGrid(contexts)
    # plain averaging (no server momentum): each model is the last one plus the round's mean update
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 3, "compression": "topk", "server-momentum": 0.0,
                                                      "compression-fraction": 0.01, "compression-sync-every": 3})
    run_id = federation.run()
    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    models = _round_models(repo, run_id)
    train = [r for r in grid.replies if METRICS in r.content.metric_records and "train-loss" in r.content.metric_records[METRICS]]
    assert len(train) == 9
    shapes = {k: v.shape for k, v in models[1].items()}
    full_bytes = 4 * sum(int(np.prod(s)) for s in shapes.values())

    # Round 2: compressed. The new model = round-1 model + weighted mean of the written-out top-k updates.
    second = train[3:6]
    assert all(UPDATE in r.content.array_records and ARRAYS not in r.content.array_records for r in second)
    assert all(r.content.config_records[COMPRESSION]["scheme"] == "topk" for r in second)
    weights = np.array([r.content.metric_records[METRICS]["num-examples"] for r in second])
    deltas = [_topk_delta(r, shapes) for r in second]
    for key in shapes:
        expected = models[1][key] + sum(w * d[key] for w, d in zip(weights, deltas, strict=True)) / weights.sum()
        np.testing.assert_allclose(models[2][key], expected, rtol=1e-5, atol=1e-6)

    # Round 3 is the full-precision sync: update + the whole residual, uncompressed; residual cleared.
    third = train[6:9]
    assert all(r.content.config_records[COMPRESSION]["scheme"] == "none" for r in third)
    for context in contexts.values():
        residual = PersonalStore.for_node(dict(context.node_config), int(context.node_id), kind="residual").load("99")
        assert residual is not None and not any(np.any(v) for v in residual.values())

    # Bytes per node per round are in the DB: 1 % top-k is over 50× smaller than the full update.
    sent = {(m.round, m.node_id): m.value for m in repo.metrics(run_id, name="uplink-bytes")}
    assert len(sent) == 9
    for node in contexts:
        assert full_bytes < sent[(3, node)] < full_bytes + 200  # one Array's header on top of the floats
        # This 17k-parameter model keeps ~175 entries (~3 bytes each) plus two Array headers.
        assert full_bytes / sent[(2, node)] > 40


def test_topk_warmup_sends_denser_updates_in_the_first_rounds(tmp_path: Path) -> None:
    grid = LoopbackGrid(_contexts(tmp_path))
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 3, "compression": "topk", "compression-fraction": 0.01,
                                                      "compression-warmup-rounds": 2})
    run_id = federation.run()
    assert repo.get_run(run_id).status == RunStatus.COMPLETED
    train = [r for r in grid.replies if COMPRESSION in r.content.config_records]
    assert [r.content.config_records[COMPRESSION]["fraction"] for r in train[::3]] == [0.25, 0.0625, 0.01]
    kept = [r.content.array_records[UPDATE]["val"].numpy().size for r in train[::3]]
    size = sum(int(np.prod(v.shape)) for v in _round_models(repo, run_id)[1].values())
    assert kept == [int(np.ceil(f * size)) for f in (0.25, 0.0625, 0.01)]
    with pytest.raises(ConfigError, match="compression-warmup-rounds applies to compression = 'topk'"):
        RunConfig.from_mapping({"compression": "sign", "compression-warmup-rounds": 2})


def test_compression_with_secure_aggregation_is_refused() -> None:
    with pytest.raises(ConfigError, match="compression topk with secure-aggregation masking"):
        RunConfig.from_mapping({"compression": "topk", "secure-aggregation": "masking"})
    with pytest.raises(ConfigError, match="compression must be one of"):
        RunConfig.from_mapping({"compression": "zip"})


def test_shared_randk_under_masking_equals_the_plaintext_run(tmp_path: Path) -> None:
    randk = {"num-rounds": 2, "compression": "randk", "compression-fraction": 0.1, "strategy": "fedavg"}
    plain_grid = LoopbackGrid(_contexts(tmp_path / "plain"))
    plain, plain_repo = _federation(tmp_path / "plain", plain_grid, **randk)
    masked_grid = LoopbackGrid(_contexts(tmp_path / "masked"))
    masked, masked_repo = _federation(tmp_path / "masked", masked_grid, **randk, **{"secure-aggregation": "masking"})
    plain_models = _round_models(plain_repo, plain.run())
    masked_run = masked.run()
    assert masked_repo.get_run(masked_run).status == RunStatus.COMPLETED
    masked_models = _round_models(masked_repo, masked_run)
    # The masked vectors carry only the shared coordinates: 2 header values + 10 % of the model.
    from quorumfl.protocol.secure_wire import MASKED
    masked_replies = [r for r in masked_grid.replies if MASKED in r.content.array_records]
    sizes = {sum(int(np.prod(a.shape)) for a in r.content.array_records[MASKED].values()) for r in masked_replies}
    model_size = sum(v.size for v in plain_models[1].values())
    assert len(sizes) == 1 and sizes.pop() < 0.11 * model_size + 64
    for number in (1, 2):
        for key, value in plain_models[number].items():
            np.testing.assert_allclose(masked_models[number][key], value, rtol=0, atol=2e-4)
    # The server recorded each masked reply's size: a tenth of the plaintext update, or less.
    plain_sent = {m.value for m in plain_repo.metrics(plain_repo.list_runs()[0].id, name="uplink-bytes")}
    masked_sent = [m.value for m in masked_repo.metrics(masked_run, name="uplink-bytes")]
    assert len(masked_sent) == 6 and max(masked_sent) < 0.11 * 4 * model_size + 300
    assert min(plain_sent) > 0
    # Coordinates outside the round-1 sample did not move in round 1.
    moved = sum(int(np.count_nonzero(masked_models[1][k] != _initial(masked_repo)[k])) for k in masked_models[1])
    assert moved <= 0.1 * model_size + 10


def _initial(repo: object) -> dict[str, np.ndarray]:
    from quorumfl.core.models import build_model, model_to_arrays

    return model_to_arrays(build_model("mlp", (1, 8, 8), 10, seed=0))
