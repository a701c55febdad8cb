"""Update monitoring and robust aggregation in real rounds (loopback grid, real local training): a
department whose updates are scaled ×50 is flagged in the round it starts and in no other node;
``norm-bound`` keeps the model near the clean run's while the weighted mean is dragged away; a
robust rule is refused where the server never sees single updates."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message

from quorumfl.core.data.store import read_partition, write_partition
from quorumfl.errors import ConfigError
from quorumfl.protocol.wire import ARRAYS, from_array_record
from quorumfl.server.config import RunConfig
from quorumfl.server.report import report_data

from .test_cli_truth import cli
from .test_rounds import LoopbackGrid, _contexts, _federation, _with_arrays, task_identity  # noqa: F401

SCALE = 50.0


def scaled(request: Message, reply: Message) -> Message:
    """The node sends the model it received plus 50× the change it trained."""
    start = from_array_record(request.content.array_records[ARRAYS])
    return _with_arrays(request, reply, lambda a: {k: (start[k] + SCALE * (v - start[k])).astype(v.dtype) for k, v in a.items()})


def _run(tmp_path: Path, parts: dict[str, Path], *, attack: bool, **config: object) -> tuple[dict[int, dict[str, float]], list[float], int]:
    contexts = _contexts(parts)
    bad = list(contexts)[2]
    grid = LoopbackGrid(contexts, {bad: scaled} if attack else {})
    federation, repo = _federation(tmp_path, grid, **{"num-rounds": 3, "local-epochs": 1, "seed": 0, **config})
    run_id = federation.run()
    flags: dict[int, dict[str, float]] = {}
    for metric in repo.metrics(run_id, name="update-flagged"):
        flags.setdefault(metric.round, {})[int(metric.node_id or 0)] = metric.value
    accuracy = [m.value for m in repo.metrics(run_id, name="accuracy")]
    counted = [m.value for m in repo.metrics(run_id, name="flagged-nodes")]
    assert len(counted) == 3
    return flags, accuracy, bad


def test_a_scaled_department_is_flagged_from_its_first_round(tmp_path: Path, six_parts: dict[str, Path],
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    flags, _, bad = _run(tmp_path / "attacked", six_parts, attack=True)
    for number in (1, 2, 3):
        assert flags[number][bad] == 1.0, number
        assert all(v == 0.0 for node, v in flags[number].items() if node != bad), flags[number]
    # rounds list says so too, naming the department
    url = f"sqlite:///{tmp_path / 'attacked' / 'state.db'}"
    code, out, err = cli(monkeypatch, capsys, "--db", url, "rounds", "list", "1", "--format", "json")
    assert code == 0, err
    assert [r["flagged"]["count"] for r in json.loads(out)] == [1, 1, 1]
    code, out, _ = cli(monkeypatch, capsys, "--db", url, "rounds", "list", "1")
    assert "round 1: 1 update(s) stood out (public-works)" in out
    clean, _, _ = _run(tmp_path / "clean", six_parts, attack=False)
    assert all(v == 0.0 for rnd in clean.values() for v in rnd.values())  # no false flags on the honest run


@pytest.mark.slow
def test_norm_bound_resists_the_scaled_department(tmp_path: Path, six_parts: dict[str, Path]) -> None:
    _, clean, _ = _run(tmp_path / "clean", six_parts, attack=False)
    _, attacked, _ = _run(tmp_path / "fedavg", six_parts, attack=True)
    _, bounded, _ = _run(tmp_path / "bounded", six_parts, attack=True, **{"robust-aggregation": "norm-bound"})
    _, median, _ = _run(tmp_path / "median", six_parts, attack=True, **{"robust-aggregation": "median"})
    assert attacked[-1] < clean[-1] - 0.05  # the weighted mean is dragged away
    assert bounded[-1] > clean[-1] - 0.05 and median[-1] > clean[-1] - 0.1
    assert np.all(np.isfinite([*bounded, *median]))


@pytest.mark.parametrize("conflict", [{"secure-aggregation": "masking"}, {"secure-aggregation": "ckks"},
                                      {"strategy": "ifca"}, {"strategy": "scaffold"}])
def test_robust_rules_are_refused_where_single_updates_are_not_seen(conflict: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="robust-aggregation"):
        RunConfig.from_mapping({"robust-aggregation": "median", **conflict})


def _break_export(part: Path) -> None:
    """The department's images arrive ×50 (pixels 0–255 read as if 0–5.1 were the scale)."""
    broken = read_partition(part)
    write_partition(part, replace(broken, train=replace(broken.train, x=broken.train.x * 50),
                                  test=replace(broken.test, x=broken.test.x * 50)))


def _reference_flags(norms: list[float], losses: list[float]) -> tuple[list[int], list[int], int]:
    """Plain reference for a secure round's monitoring: each node's half-decade bucket by log10 (norms
    from 10^-4, losses from 10^-3, 16 buckets), the histograms, and how many nodes lie two or more
    buckets above the (lower) median node's bucket, the larger count of norm and loss."""
    def buckets(values: list[float], low: float) -> list[int]:
        return [15 if not np.isfinite(v) else int(min(15, max(0, np.floor(2 * (np.log10(v) - low)) + 1))) if v > 0 else 0
                for v in values]
    norm_b, loss_b = buckets(norms, -4.0), buckets(losses, -3.0)
    flagged = max(sum(b >= sorted(bs)[(len(bs) - 1) // 2] + 2 for b in bs) for bs in (norm_b, loss_b))
    return np.bincount(norm_b, minlength=16).tolist(), np.bincount(loss_b, minlength=16).tolist(), flagged


@pytest.mark.parametrize("mode", ["masking", "ckks"])
def test_under_secure_aggregation_the_histograms_show_a_broken_department(tmp_path: Path, six_parts: dict[str, Path],
                                                                           mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The revealed histograms and the flag count equal a plain count of what each node measured, in
    every round; the broken department is counted in the round it starts, and a clean run counts none.
    (Later rounds count it only while its own norm or loss stays ≥ 10× the median's: the model adapts
    to it, and with some seeds its second update falls within that.)"""
    import quorumfl.client.ckks as client_ckks
    import quorumfl.client.secure as client_secure
    from quorumfl.aggregation.secagg import weighted_payload

    measured: list[tuple[float, float]] = []  # (update norm, train loss) of each payload a node built

    def recording(update: np.ndarray, **kwargs: float) -> np.ndarray:
        measured.append((float(np.linalg.norm(update)), kwargs["loss"]))
        return weighted_payload(update, **kwargs)

    for module in (client_secure, client_ckks):
        monkeypatch.setattr(module, "weighted_payload", recording)
    secure = {"secure-aggregation": mode, "secagg-threshold": 0.6, "num-rounds": 2, "local-epochs": 1}
    counts = {}
    for name, broken in (("clean", False), ("broken", True)):
        parts = dict(six_parts)
        if broken:
            copy = tmp_path / "broken-housing"
            shutil.copytree(parts["housing"], copy)
            _break_export(copy)
            parts["housing"] = copy
        measured.clear()
        federation, repo = _federation(tmp_path / name, LoopbackGrid(_contexts(parts)), **secure)
        run_id = federation.run()
        counts[name] = [m.value for m in repo.metrics(run_id, name="flagged-nodes")]
        assert not repo.metrics(run_id, name="update-norm")  # no single update was seen
        assert len(measured) == 12  # six nodes, two rounds, all counted
        for number in (1, 2):
            norms, losses, flagged = _reference_flags(*map(list, zip(*measured[6 * (number - 1):6 * number], strict=True)))
            stored = {m.name: m.value for m in repo.metrics(run_id) if m.round == number}
            assert [stored.get(f"norm-histogram-{i:02d}", 0.0) for i in range(16)] == norms, (name, number)
            assert [stored.get(f"loss-histogram-{i:02d}", 0.0) for i in range(16)] == losses, (name, number)
            assert counts[name][number - 1] == flagged, (name, number, measured)
        shown = report_data(repo, run_id)["histograms"]
        assert [(h["round"], h["flagged"], sum(h["norm"].values())) for h in shown] == [
            (r, counts[name][r - 1], 6.0) for r in (1, 2)]
    assert counts["clean"] == [0.0, 0.0]
    assert counts["broken"][0] == 1.0  # counted in the round it starts
