"""Distributed DP: clipping bound, noise share variance, and the noise a revealed masked sum carries."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from quorumfl.core.data import prepare_partitions
from quorumfl.errors import ConfigError
from quorumfl.privacy.accounting import epsilon
from quorumfl.privacy.distributed import clip_update, noisy_share
from quorumfl.privacy.ledger import Ledger
from quorumfl.server.config import RunConfig
from quorumfl.server.model_store import ModelStore
from quorumfl.server.state.repository import RunStatus

from ..server.test_rounds import LoopbackGrid, _federation, task_identity  # noqa: F401  (an autouse fixture)


@given(arrays(np.float64, st.integers(1, 50), elements=st.floats(-1e3, 1e3)), st.floats(0.01, 10))
def test_clip_bounds_the_norm_and_keeps_the_direction(x: np.ndarray, clip: float) -> None:
    out = clip_update(x, clip)
    assert np.linalg.norm(out) <= clip * (1 + 1e-9)
    if np.linalg.norm(x) <= clip:
        np.testing.assert_array_equal(out, x)
    else:
        np.testing.assert_allclose(out * np.linalg.norm(x) / clip, x, rtol=1e-9, atol=1e-9)


def test_noise_share_variance() -> None:
    rng = np.random.default_rng(0)
    out = noisy_share(np.zeros(200_000), clip=2.0, noise_multiplier=1.5, share=4, rng=rng)
    assert np.std(out) == pytest.approx(1.5 * 2.0 / 2, rel=0.01)  # σC/√share
    with pytest.raises(ConfigError, match="noise share"):
        noisy_share(np.zeros(3), clip=1.0, noise_multiplier=1.0, share=0, rng=rng)


def test_distributed_dp_needs_masking() -> None:
    with pytest.raises(ConfigError, match="secure-aggregation = 'masking'"):
        RunConfig.from_mapping({"dp": "distributed", "secure-aggregation": "none"})


def _contexts(tmp_path: Path) -> dict[int, Context]:
    parts = prepare_partitions(tmp_path / "data", ["tax-office", "urban-planning", "housing"], seed=0, method="iid")
    return {1000 + i: Context(run_id=99, node_id=1000 + i,
                              node_config={"data-path": str(p), "department": name, "dp-budget": 100.0},
                              state=RecordDict(), run_config={})
            for i, (name, p) in enumerate(parts.items())}


def test_a_revealed_sum_carries_the_full_noise(tmp_path: Path) -> None:
    run = {"num-rounds": 1, "strategy": "fedavg", "secure-aggregation": "masking", "dp": "distributed",
           "dp-epsilon": 0.0, "dp-noise-multiplier": 0.5, "dp-clip": 0.1, "secagg-threshold": 2}
    models = []
    for name in ("a", "b"):  # the same run twice: identical clipped updates, independent noise
        contexts = _contexts(tmp_path / name)
        federation, repo = _federation(tmp_path / name, LoopbackGrid(contexts), **run)
        run_id = federation.run()
        assert repo.get_run(run_id).status == RunStatus.COMPLETED
        version = repo.list_model_versions(run_id=run_id)[0]
        models.append(ModelStore.load(version.path, version.sha256))
        # The federation's ε is the PRV accountant's for one Gaussian mechanism with σ = 0.5.
        reported = {m.name: m.value for m in repo.metrics(run_id) if m.node_id is None}
        assert reported["dp-federation-epsilon"] == pytest.approx(epsilon([(0.5, 1.0, 1)], 1e-5))
        # Each department charged its own ledger the same mechanism.
        ledger = Ledger.open(Path(str(contexts[1000].node_config["data-path"])))
        assert [(s.noise_multiplier, s.sample_rate, s.steps) for s in ledger.spends()] == [(0.5, 1.0, 1)]
    diff = np.concatenate([(models[0][k] - models[1][k]).ravel() for k in models[0]]).astype(np.float64)
    # Each mean = (Σ clipped + Σ noise shares) / 3; 3 shares of variance σ²C²/t (t = 2) per sum.
    per_mean = 0.5 * 0.1 * np.sqrt(3 / 2) / 3
    assert np.std(diff) == pytest.approx(per_mean * np.sqrt(2), rel=0.05)


def test_constant_coordinates_are_sent_as_zero_and_the_rest_clipped_and_noised_as_before() -> None:
    """The tabular model's standardisation buffers, which no DP round changes, get no noise (noise
    there would move σ² and blow up the inputs); they are forced to 0 whatever the update holds, and
    the other coordinates are clipped on their own norm and noised with the same σ·C/√share."""
    rng = np.random.default_rng(1)
    update = np.concatenate([np.full(100_000, 0.01), np.full(5, 3.0)])  # 5 "buffer" coordinates, nonzero on purpose
    constant = np.zeros(update.shape, dtype=bool)
    constant[-5:] = True
    out = noisy_share(update, clip=2.0, noise_multiplier=1.5, share=4, rng=rng, constant=constant)
    assert np.all(out[-5:] == 0.0)
    free = out[:-5] - clip_update(update[:-5], 2.0)  # the noise alone
    assert abs(float(np.std(free)) / (1.5 * 2.0 / 2) - 1) < 0.02
    with pytest.raises(ConfigError, match="mask has shape"):
        noisy_share(update, clip=2.0, noise_multiplier=1.5, share=4, rng=rng, constant=constant[:-1])
