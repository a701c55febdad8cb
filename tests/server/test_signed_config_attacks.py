"""An active server against the admin-signed run config: it asks the departments for what the admin did
not sign — a plaintext update in a masked or encrypted run, training without DP in a DP run, less noise
than the run's ε implies — and every department refuses before it trains or sends anything.

The attacker is the real federation loop run with the server's own (altered) config; the nodes hold
the signed one in their run config, as the launch gate hands it to them in a deployment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from quorumfl.client.signed_config import check_train_request
from quorumfl.errors import FederationError, PrivacyBudgetError, SecureAggregationError
from quorumfl.protocol.ckks_wire import ENCRYPTED
from quorumfl.protocol.secure_wire import MASKED
from quorumfl.protocol.wire import ARRAYS, UPDATE, TrainConfig
from quorumfl.server.config import RunConfig

from .test_rounds import LoopbackGrid, _contexts, _federation, task_identity  # noqa: F401


def _signed(**overrides: Any) -> dict[str, Any]:
    """The whole run config as a deployed run's signed bundle holds it."""
    return RunConfig.from_mapping({"num-rounds": 1, "min-nodes": 2, "fraction-train": 1.0, "secure-aggregation": "none",
                                   **overrides}).resolved()


def _attack(tmp_path: Path, parts: dict[str, Path], signed: dict[str, Any], **server: Any) -> tuple[LoopbackGrid, Any]:
    contexts = _contexts(parts, {"dp-budget": 100.0})
    for context in contexts.values():
        context.run_config = dict(signed)
    grid = LoopbackGrid(contexts)
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 1, "min-nodes": 2, "fraction-train": 1.0, **server})
    with pytest.raises(FederationError, match="none of the 1 round"):
        federation.run()
    (run,) = repo.list_runs()
    return grid, repo.get_run(run.id)


def _no_update_left_a_node(grid: LoopbackGrid) -> None:
    trained = [r for r in grid.replies if not r.has_error() and (ARRAYS in r.content.array_records
                                                                 or UPDATE in r.content.array_records)]
    assert trained == [], "a department sent its update to a server that broke the signed run config"


@pytest.mark.parametrize("mode", ["masking", "ckks"])
def test_a_plaintext_train_request_in_a_secure_run_is_refused(tmp_path: Path, six_parts: dict[str, Path],
                                                              mode: str) -> None:
    grid, run = _attack(tmp_path, six_parts, _signed(**{"secure-aggregation": mode}), **{"secure-aggregation": "none"})
    _no_update_left_a_node(grid)
    assert grid.replies and all(r.has_error() for r in grid.replies)
    assert f"sets secure-aggregation = {mode}" in grid.replies[0].error.reason
    assert str(run.rounds[0].status) in ("failed", "RoundStatus.FAILED") and len(run.rounds[0].failures) == len(six_parts)


def test_a_dp_downgrade_is_refused(tmp_path: Path, six_parts: dict[str, Path]) -> None:
    signed = _signed(dp="local", **{"dp-epsilon": 5.0})
    grid, run = _attack(tmp_path, six_parts, signed, dp="none")
    _no_update_left_a_node(grid)
    reasons = {f.reason for f in run.rounds[0].failures}
    assert len(run.rounds[0].failures) == len(six_parts)
    assert any("asks for dp = 'none', the admin-signed run config sets 'local'" in r for r in reasons), reasons


def test_less_distributed_noise_than_the_signed_epsilon_implies_is_refused(
    tmp_path: Path, six_parts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    secure = {"secure-aggregation": "masking", "secagg-threshold": 0.6, "dp": "distributed", "dp-epsilon": 2.0}
    # the server's own code asks for a noise multiplier of its choosing instead of the one the signed ε gives
    monkeypatch.setattr("quorumfl.server.rounds.distributed_noise", lambda config: 0.05)
    grid, run = _attack(tmp_path, six_parts, _signed(**secure), **secure)
    _no_update_left_a_node(grid)
    reasons = " ".join(f.reason for f in run.rounds[0].failures)
    assert "noise multiplier 0.05, below the" in reasons


def _config(**changes: Any) -> TrainConfig:
    base = TrainConfig(server_round=1, model="mlp", local_epochs=1, batch_size=8, learning_rate=0.1, proximal_mu=0.0,
                       seed=0, dp="local", dp_epsilon=3.0, dp_clip=1.0, dp_delta=1e-5)
    return TrainConfig(**{**base.__dict__, **changes})


@pytest.mark.parametrize(("changes", "message"), [
    ({"dp_clip": 10.0}, "dp-clip = 10"),
    ({"dp_delta": 1e-2}, "dp-delta = 0.01"),
    ({"dp_epsilon": 30.0}, "dp-epsilon = 30"),
    ({"dp": "none"}, "dp = 'none'"),
])
def test_each_privacy_setting_must_be_the_signed_one(changes: dict[str, Any], message: str) -> None:
    signed = _signed(dp="local", **{"dp-epsilon": 3.0})
    check_train_request(signed, _config(), masked=False, encrypted=False, node="1")  # as signed: accepted
    with pytest.raises(PrivacyBudgetError, match=message):
        check_train_request(signed, _config(**changes), masked=False, encrypted=False, node="1")


def test_a_secure_request_and_an_unsigned_test_config_pass() -> None:
    signed = _signed(**{"secure-aggregation": "masking"})
    check_train_request(signed, _config(dp="none"), masked=True, encrypted=False, node="1")
    with pytest.raises(SecureAggregationError, match="withheld"):
        check_train_request(signed, _config(dp="none"), masked=False, encrypted=True, node="1")
    check_train_request({}, _config(dp="none"), masked=False, encrypted=False, node="1")


def test_a_noise_share_thinner_than_the_reveal_quorum_is_refused(
    tmp_path: Path, six_parts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Distributed DP: each node adds 1/t of the noise, t the fewest inputs of a revealed sum. A server
    that names a larger divisor would make every node add too little."""
    from dataclasses import replace

    secure = {"secure-aggregation": "masking", "secagg-threshold": 0.6, "dp": "distributed", "dp-epsilon": 2.0}
    monkeypatch.setattr("quorumfl.server.secure._with_noise_share",
                        lambda config, quorum: replace(config, dp_noise_share=100 * quorum))
    grid, run = _attack(tmp_path, six_parts, _signed(**secure), **secure)
    _no_update_left_a_node(grid)
    assert any("divides the DP noise among" in (r.error.reason if r.has_error() else "") for r in grid.replies)


def test_a_request_that_would_take_fedpers_personal_layers_is_refused(tmp_path: Path,
                                                                      six_parts: dict[str, Path]) -> None:
    signed = _signed(strategy="fedper", **{"personal-layers": "head"})
    grid, run = _attack(tmp_path, six_parts, signed, strategy="fedavg")  # the server asks for every layer back
    _no_update_left_a_node(grid)
    assert all(r.has_error() and "personal layers stay on the node" in r.error.reason for r in grid.replies)
    check_train_request(signed, _config(dp="none", personalisation="fedper", personal_layers="head"),
                        masked=False, encrypted=False, node="1")
    with pytest.raises(SecureAggregationError, match="personal layers"):
        check_train_request(signed, _config(dp="none", personalisation="fedper", personal_layers="0"),
                            masked=False, encrypted=False, node="1")


@pytest.mark.parametrize("mode", ["masking", "ckks"])
def test_a_looser_update_norm_bound_than_the_signed_one_is_refused(tmp_path: Path, six_parts: dict[str, Path],
                                                                   mode: str) -> None:
    """The admin bounded every department's update; a server that lifts the bound (to let a broken or
    hostile department's update weigh more) gets no update."""
    secure = {"secure-aggregation": mode, "secagg-threshold": 0.6}
    grid, run = _attack(tmp_path, six_parts, _signed(**secure, **{"update-norm-bound": 1.0}),
                        **secure, **{"update-norm-bound": 0.0})
    sent = [r for r in grid.replies if not r.has_error()
            and ({MASKED, ENCRYPTED, ARRAYS, UPDATE} & set(r.content.array_records))]
    assert sent == [], "a department sent its update under a bound the admin did not sign"
    failures = run.rounds[0].failures
    assert len(failures) == len(six_parts)
    assert all(f.stage == "train" and "update-norm-bound 0, the admin-signed run config sets 1" in f.reason
               for f in failures)
